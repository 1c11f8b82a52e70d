"""Two levels: in-memory snapshots in shared-memory slots, persists to storage, and two-level recovery that
takes every unit from its newest surviving copy.

:class:`~moc_lightning.memory.two_level.TwoLevelCheckpointer` (``two_level``) guards and delegates to one part a job:
the slots (``snapshot``) and taking a snapshot into them (``snapshotting``, timed against ``copy_speed``), the persist
in flight (``persisting``), the final persist (``final_persist``), recovery (``recovering``, planned by ``recovery``,
restoring from memory by ``restoring``), the trainer state as text (``encoding``) and the counters (``stats``).

Imports :mod:`moc_lightning.pec` and below.
"""

"""Partial Experts Checkpointing: the engine that saves every dense unit and K experts of each MoE layer, persists
and commits them through DCP, and loads and accounts a recovery.

:class:`~moc_lightning.pec.checkpointer.PECCheckpointer` (``checkpointer``) is the manager a caller holds; it composes
one part a job: token accounting (``tokens``), choosing the experts (``selecting``), sizing a snapshot slot
(``sizing``), the write plan over ownership, pieces and ZeRO partitions (``write_plan``), a persist through DCP
(``persist``) and its commit (``commit``, with the collective outcomes of ``outcomes``), and reading checkpoints back
(``loading``, over what storage holds: ``stored``).

Imports :mod:`moc_lightning.sharding`, :mod:`moc_lightning.config` and below.
"""

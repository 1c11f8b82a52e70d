"""Two levels: in-memory snapshots in shared-memory slots, persists to storage, and two-level recovery that
takes every unit from its newest surviving copy.

Imports :mod:`moc_lightning.pec` and below.
"""

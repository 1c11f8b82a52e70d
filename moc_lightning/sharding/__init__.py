"""Who writes what: ownership of every unit's rows, the DCP save planner that writes each replicated byte once,
replica writes under HSDP, the ZeRO-2 optimizer that partitions optimizer state by unit, and the paper's accounting.

Imports :mod:`moc_lightning.engine` and below.
"""

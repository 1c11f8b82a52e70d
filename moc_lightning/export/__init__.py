"""Out of MoC's format: dense consolidation of a run's partial checkpoints (``moc-consolidate``) and Hugging
Face's own checkpoint format.

Imports :mod:`moc_lightning.pec` and below.
"""

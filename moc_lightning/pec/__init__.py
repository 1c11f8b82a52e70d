"""Partial Experts Checkpointing: the engine that saves every dense unit and K experts of each MoE layer, persists
and commits them through DCP, and loads and accounts a recovery.

Imports :mod:`moc_lightning.sharding`, :mod:`moc_lightning.config` and below.
"""

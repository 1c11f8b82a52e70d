"""The Lightning glue: the ``MoCCheckpoint`` callback (it decides *when*), how a run starts on storage, how it
stands beside Lightning's own checkpointing, and what ``validate``/``test``/``predict`` load.

Imports the engines (:mod:`moc_lightning.memory`, :mod:`moc_lightning.replay`, :mod:`moc_lightning.export`) and
below; never :mod:`moc_lightning.models`, :mod:`moc_lightning.jobs` or :mod:`moc_lightning.tools`.
"""

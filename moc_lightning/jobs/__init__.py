"""The Hydra training jobs behind ``recipes/train.py`` and ``recipes/train_hf.py``: typed config trees, Trainer
assembly, the run.

Imports :mod:`moc_lightning.lightning`, :mod:`moc_lightning.models`, :mod:`moc_lightning.data` and below.
"""

"""What a checkpoint is made of, independent of how it is written: units and their parts, the layout of a model
and its optimizer, pieces of sharded state, the selection of experts, the token ledger and router counts, the size
model, lineage, the manifest, the training state besides tensors, and whether a restore is complete.

Imports :mod:`moc_lightning.runtime` and :mod:`moc_lightning.storage` only.
"""

"""The process and its peers: collective agreement, background threads, the expert-parallel topology, fault
injection points, and ``torchrun`` from one process.

Imports nothing of moc_lightning: every other part may build on it.
"""

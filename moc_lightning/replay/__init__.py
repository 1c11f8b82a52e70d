"""Replay mode (``checkpoint.mode=replay``): sparse captures over a window of iterations, windows kept in memory
and in storage, the choice of the window, and the sparse-to-dense replay that rebuilds the state at a resume.

Imports :mod:`moc_lightning.memory` and below.
"""

"""The Lightning glue: the ``MoCCheckpoint`` callback (it decides *when*) and, one job a module, the *how* it hands
to the engines: building them (``engines``, ``shared_memory``), how a run starts on storage (``start``), routing
Lightning's loads (``loads``, through ``wrapping``) to a restore (``recovery``), replay mode (``replay_wiring``),
router counts (``tokens``), what is logged and printed (``reporting``), how it stands beside Lightning's own
checkpointing (``coexistence``), and what ``validate``/``test``/``predict`` load (``evaluation``).

Imports the engines (:mod:`moc_lightning.memory`, :mod:`moc_lightning.replay`, :mod:`moc_lightning.export`) and
below; never :mod:`moc_lightning.models`, :mod:`moc_lightning.jobs` or :mod:`moc_lightning.tools`.
"""

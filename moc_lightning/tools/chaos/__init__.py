"""Randomized fault trials with an independent oracle (issue 11).

- :mod:`~moc_lightning.tools.chaos.oracle`: a Lightning callback that records, per rank and step, a digest of every
  tensor of the training state and the ids of the samples trained on, into append-only files;
- :mod:`~moc_lightning.tools.chaos.checks`: pure checks over those records (restored state, data continuity,
  completion);
- :mod:`~moc_lightning.tools.chaos.worker`: the training job one launch runs (``torchrun --standalone``'s agent);
- :mod:`~moc_lightning.tools.chaos.harness`: draws faults, runs the incarnations of a trial, applies damage and
  node losses between them, and tallies the checks.

The oracle shares no code with MoC's layout or recovery: what it compares is computed from the module and
optimizer as a user sees them, so a bug in MoC's own view cannot hide itself.
"""

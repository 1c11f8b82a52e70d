"""Measurement and test tools, not part of a training run: the bench, the host memory probe, the cluster and MTBF
projections, the chaos harness, ``key=value`` command lines.

May import everything else; nothing imports it.
"""

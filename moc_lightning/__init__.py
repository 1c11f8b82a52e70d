"""moc_lightning: Mixture-of-Checkpoint (MoC-System) fault tolerance for MoE training on PyTorch Lightning."""

__version__ = "0.1.0"

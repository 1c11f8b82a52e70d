"""moc_lightning: Mixture-of-Checkpoint (MoC-System) fault tolerance for MoE training on PyTorch Lightning."""

from moc_lightning.config import CheckpointConfig, DynamicKConfig, ReplayConfig, StorageConfig
from moc_lightning.lightning.callback import MoCCheckpoint

__version__ = "0.1.0"
__all__ = ["CheckpointConfig", "DynamicKConfig", "MoCCheckpoint", "ReplayConfig", "StorageConfig"]

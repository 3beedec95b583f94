"""SparrowRL: lossless sparse delta checkpoints for RL weight sync over commodity networks."""

__version__ = "0.1.0"

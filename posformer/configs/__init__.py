"""Hydra configs shipped with posformer (``configs/`` in the repository is a symlink here)."""

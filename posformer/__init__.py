"""posformer: a mini Transformer training framework with pluggable positional encodings."""

from typing import Any

from posformer.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    PosformerError,
    PosformerWarning,
    PositionRangeError,
    RunInterrupted,
)
from posformer.model import DecoderOnlyTransformer, EncoderDecoderTransformer, ModelConfig, build_model
from posformer.pe import ENCODINGS, build_encoding, list_encodings

__version__ = "0.1.0"

#: the Python API (posformer/api.py, docs/api.md), imported on first use: ``import posformer`` stays light
_API = (
    "EvalResult",
    "Run",
    "TrainResult",
    "evaluate",
    "export_hf",
    "hf_to_checkpoint",
    "import_hf",
    "load_run",
    "train",
)


def __getattr__(name: str) -> Any:
    """``posformer.train``, ``posformer.evaluate``, ``posformer.load_run`` and their results classes."""
    if name in _API:
        import posformer.api

        return getattr(posformer.api, name)
    raise AttributeError(f"module 'posformer' has no attribute {name!r}")


__all__ = [
    "ENCODINGS",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DecoderOnlyTransformer",
    "EncoderDecoderTransformer",
    "EvalResult",
    "ModelConfig",
    "PositionRangeError",
    "PosformerError",
    "PosformerWarning",
    "Run",
    "RunInterrupted",
    "TrainResult",
    "build_encoding",
    "build_model",
    "evaluate",
    "list_encodings",
    "load_run",
    "train",
]

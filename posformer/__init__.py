"""posformer: a mini Transformer training framework with pluggable positional encodings."""

from posformer.errors import CheckpointError, ConfigError, DataError, PosformerError, PositionRangeError
from posformer.model import DecoderOnlyTransformer, EncoderDecoderTransformer, ModelConfig, build_model
from posformer.pe import ENCODINGS, build_encoding, list_encodings

__version__ = "0.1.0"

__all__ = [
    "ENCODINGS",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DecoderOnlyTransformer",
    "EncoderDecoderTransformer",
    "ModelConfig",
    "PositionRangeError",
    "PosformerError",
    "build_encoding",
    "build_model",
    "list_encodings",
]

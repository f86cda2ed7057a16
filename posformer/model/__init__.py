"""Models and attention: configs, the two Transformers, attention and its backends, positions.

See :mod:`posformer.model.attention` for the layout of the package.
"""

from posformer.model.attention import AttentionContext, MultiHeadAttention, attend
from posformer.model.cache import KVCache, LayerCache
from posformer.model.config import ModelConfig
from posformer.model.transformer import DecoderOnlyTransformer, EncoderDecoderTransformer, build_model

__all__ = [
    "AttentionContext",
    "DecoderOnlyTransformer",
    "EncoderDecoderTransformer",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "MultiHeadAttention",
    "attend",
    "build_model",
]

from posformer.model.attention import AttentionContext, MultiHeadAttention, attend
from posformer.model.config import ModelConfig
from posformer.model.transformer import (
    DecoderOnlyTransformer,
    EncoderDecoderTransformer,
    KVCache,
    build_model,
)

__all__ = [
    "AttentionContext",
    "DecoderOnlyTransformer",
    "EncoderDecoderTransformer",
    "KVCache",
    "ModelConfig",
    "MultiHeadAttention",
    "attend",
    "build_model",
]

"""The RoPE family: rotary position embedding, its context-extension scalings, and xPos."""

from posformer.pe.rope.rotary import RotaryEncoding
from posformer.pe.rope.xpos import XPosEncoding

__all__ = ["RotaryEncoding", "XPosEncoding"]

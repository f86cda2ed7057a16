"""The RoPE family: rotary position embedding, its context-extension scalings, xPos, and PoPE."""

from posformer.pe.rope.polar import PolarEncoding
from posformer.pe.rope.rotary import RotaryEncoding
from posformer.pe.rope.xpos import XPosEncoding

__all__ = ["PolarEncoding", "RotaryEncoding", "XPosEncoding"]

"""The RoPE family: rotary position embedding, its context-extension scalings, xPos, and PoPE
(``polar.py``, registered after every other family by ``posformer.pe``: the figures' colours follow
registry order)."""

from posformer.pe.rope.rotary import RotaryEncoding
from posformer.pe.rope.xpos import XPosEncoding

__all__ = ["RotaryEncoding", "XPosEncoding"]

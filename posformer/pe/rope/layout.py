"""Converting q/k projection weights between the ``half`` and ``interleaved`` RoPE layouts.

The two layouts pair different dimensions of each head (``half``: ``(x_i, x_{i+R/2})``, GPT-NeoX /
HF Llama; ``interleaved``: ``(x_{2i}, x_{2i+1})``, RoFormer / GPT-J / Meta's Llama), so a checkpoint
trained with one gives wrong outputs with the other unless the rows of its q and k projections are
permuted within every head (HF's Llama conversion script does ``interleaved -> half``). Only the
first ``R`` = rotary dims of each head move; values and the other dims are untouched. The scores
``q·k`` are unchanged by the permutation (both sides move alike), so the converted model gives the
same logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.errors import ConfigError

LAYOUTS = ("half", "interleaved")


def layout_permutation(head_dim: int, rotary_dim: int, src: str, dst: str) -> Tensor:
    """Index ``perm`` (Dh,) with ``x_dst = x_src[perm]`` for one head."""
    for name, layout in (("src", src), ("dst", dst)):
        if layout not in LAYOUTS:
            raise ConfigError(f"rotary layout {name}={layout!r} is invalid: use 'half' or 'interleaved'.")
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ConfigError(f"rotary_dim={rotary_dim} must be even and in [2, head_dim={head_dim}].")
    rest = torch.arange(rotary_dim, head_dim)
    half = rotary_dim // 2
    # interleaved -> half: half slot a < R/2 holds interleaved 2a, slot R/2 + a holds 2a + 1
    to_half = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
    if src == dst:
        perm = torch.arange(rotary_dim)
    elif dst == "half":
        perm = to_half
    else:  # half -> interleaved: the inverse permutation
        perm = torch.empty_like(to_half)
        perm[to_half] = torch.arange(rotary_dim)
    assert perm.numel() == 2 * half
    return torch.cat((perm, rest))


def convert_projection(
    weight: Tensor, *, n_heads: int, head_dim: int, rotary_dim: int | None = None, src: str, dst: str
) -> Tensor:
    """Permute the output rows of a q or k projection ``weight`` (H·Dh, D_in) or its bias (H·Dh,)
    from layout ``src`` to ``dst``; returns a new tensor of the same shape."""
    if weight.shape[0] != n_heads * head_dim:
        raise ConfigError(
            f"projection has {weight.shape[0]} output rows, expected n_heads x head_dim = "
            f"{n_heads} x {head_dim} = {n_heads * head_dim}."
        )
    perm = layout_permutation(head_dim, rotary_dim or head_dim, src, dst)
    rows = (torch.arange(n_heads).unsqueeze(1) * head_dim + perm).flatten()  # (H·Dh,)
    return weight[rows].clone()


def convert_qkv_state_dict(
    state: dict[str, Tensor],
    *,
    n_heads: int,
    head_dim: int,
    rotary_dim: int | None = None,
    src: str,
    dst: str,
) -> dict[str, Tensor]:
    """A posformer state dict with every fused self-attention ``qkv_proj`` (weight and bias) converted:
    its q and k thirds are permuted, v is kept. Other entries are returned as they are."""
    out = dict(state)
    d = n_heads * head_dim
    for key, value in state.items():
        if key.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q, k, v = value[:d], value[d : 2 * d], value[2 * d :]
            kw = dict(n_heads=n_heads, head_dim=head_dim, rotary_dim=rotary_dim, src=src, dst=dst)
            out[key] = torch.cat((convert_projection(q, **kw), convert_projection(k, **kw), v))
    return out

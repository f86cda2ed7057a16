"""The two libraries' models at one configuration, and the model FLOPs they take per trained token."""

from __future__ import annotations

from typing import Any

from torch import nn

from posformer.bench.config import BenchConfig
from posformer.model import ModelConfig, build_model
from posformer.model.flops import flops_per_token
from posformer.pe.registry import encoding_options, get_encoding_class

#: x-transformers keyword arguments giving the same PE (None: x-transformers has no such PE); the keys
#: are posformer's registry names, the values the other library's own options
XT_PE: dict[str, dict[str, Any] | None] = {
    "nope": {"use_abs_pos_emb": False},
    "learned": {"use_abs_pos_emb": True},
    "sinusoidal": {"use_abs_pos_emb": True, "scaled_sinu_pos_emb": True},
    "rope": {"use_abs_pos_emb": False, "attn": {"rotary_pos_emb": True}},
    "alibi": {"use_abs_pos_emb": False, "attn": {"alibi_pos_bias": True}},
    "t5": {"use_abs_pos_emb": False, "attn": {"rel_pos_bias": True}, "no_flash": True},
    "xpos": {"use_abs_pos_emb": False, "attn": {"rotary_pos_emb": True, "rotary_xpos": True}},
}


def posformer_model(pe: str, cfg: BenchConfig, d_model: int, max_len: int) -> nn.Module:
    """posformer's decoder-only model with this PE; a length-limited PE gets a ``max_len`` table."""
    options = {"max_len": max_len} if "max_len" in encoding_options(get_encoding_class(pe)) else {}
    mcfg = ModelConfig(
        kind="decoder",
        vocab_size=cfg.vocab,
        d_model=d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        dropout=0.0,
        attn_dropout=0.0,
        pe=pe,
        pe_options=options,
        tie_embeddings=True,
        attention_chunk_mb=cfg.chunk_mb,
        attention_backend=cfg.attention_backend,
    )
    return build_model(mcfg)


def xt_available() -> bool:
    try:
        import x_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def xt_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("x-transformers")
    except Exception:  # noqa: BLE001 - not installed
        return None


def xt_model(pe: str, cfg: BenchConfig, d_model: int, max_len: int) -> nn.Module | None:
    """The x-transformers decoder with the same width/depth/heads/FFN/tied embeddings and this PE."""
    spec = XT_PE.get(pe)
    if spec is None or not xt_available():
        return None
    from x_transformers import Decoder, TransformerWrapper

    attn = dict(spec.get("attn", {}))
    if attn.get("rotary_pos_emb"):
        attn["rotary_emb_dim"] = d_model // cfg.n_heads  # posformer rotates the full head
    flash = not spec.get("no_flash", False)
    return TransformerWrapper(
        num_tokens=cfg.vocab,
        max_seq_len=max_len,
        tie_embedding=True,
        use_abs_pos_emb=spec["use_abs_pos_emb"],
        scaled_sinu_pos_emb=spec.get("scaled_sinu_pos_emb", False),
        attn_layers=Decoder(
            dim=d_model, depth=cfg.n_layers, heads=cfg.n_heads, attn_flash=flash, ff_mult=4, **attn
        ),
    )


def model_flops_per_token(model: nn.Module, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (:func:`flops_per_token`'s total)."""
    return flops_per_token(model, n_layers, d_model, seq_len)["total"]

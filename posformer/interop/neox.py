"""GPT-NeoX (RoPE) and GPT-2 (position tables): posformer's LayerNorm + MLP decoder in HF's names."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.interop.common import (
    LN_EPS,
    ROTARY_PE,
    half_layout,
    hf_rope_parameters,
    model_config,
    refuse,
    rope_of,
    rope_options,
    rope_problems,
    shared_config,
)
from posformer.model import ModelConfig
from posformer.pe.registry import get_encoding_class

#: rows of GPT-2's ``wpe`` for a PE without a table length (NoPE)
DEFAULT_POSITIONS = 2048


def _table_pe(name: str) -> bool:
    """Whether GPT-2's absolute position table expresses the PE ``name``: its hooks act on the embeddings
    alone (a learned or fixed table added to the tokens, or none)."""
    return get_encoding_class(name).capabilities.hooks <= {"embed"}


def neox_problems(cfg: ModelConfig, pe: Any = None) -> list[str]:
    """What GPT-NeoX and GPT-2 cannot express of a LayerNorm + MLP decoder (beyond
    :func:`~posformer.interop.common.shared_problems`)."""
    problems = []
    if cfg.norm != "layernorm" or cfg.mlp != "mlp":
        problems.append(
            f"model.norm={cfg.norm!r} with model.mlp={cfg.mlp!r} (GPT-NeoX/GPT-2: layernorm + mlp; Llama: "
            "rmsnorm + swiglu)"
        )
    if cfg.norm == "layernorm" and float(cfg.norm_eps) != LN_EPS:
        problems.append(f"model.norm_eps={cfg.norm_eps} (GPT-NeoX/GPT-2 export writes {LN_EPS})")
    if cfg.pe != ROTARY_PE and not _table_pe(cfg.pe):
        problems.append(f"pe={cfg.pe!r} (HF's GPT-NeoX and GPT-2 have RoPE or an absolute position table)")
    if cfg.pe == ROTARY_PE and pe is not None:
        problems += rope_problems(pe, cfg.n_heads)
    return problems


def to_neox(model: torch.nn.Module, state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg, pe = model.cfg, rope_of(model)
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads
    state = half_layout(state, pe, h, dh)
    params, max_pos = hf_rope_parameters(pe)
    config = {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        **shared_config(cfg),
        "hidden_size": d,
        "num_attention_heads": h,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": cfg.activation,
        "layer_norm_eps": LN_EPS,
        "use_parallel_residual": False,
        "attention_bias": bool(cfg.bias),
        "hidden_dropout": cfg.dropout,
        "attention_dropout": cfg.attn_dropout,
        "max_position_embeddings": max_pos or 2048,
        "rope_parameters": params,
    }
    out = {
        "gpt_neox.embed_in.weight": state["tok_emb.weight"],
        "gpt_neox.final_layer_norm.weight": state["norm_f.weight"],
    }
    out["gpt_neox.final_layer_norm.bias"] = state["norm_f.bias"]
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        qkv = state[src + "self_attn.qkv_proj.weight"]  # rows (3, H, Dh) -> GPT-NeoX's (H, 3, Dh)
        out[dst + "attention.query_key_value.weight"] = (
            qkv.view(3, h, dh, d).transpose(0, 1).reshape(3 * d, d)
        )
        out[dst + "attention.dense.weight"] = state[src + "self_attn.out_proj.weight"]
        if cfg.bias:
            qkv_b = state[src + "self_attn.qkv_proj.bias"]
            out[dst + "attention.query_key_value.bias"] = qkv_b.view(3, h, dh).transpose(0, 1).reshape(3 * d)
            out[dst + "attention.dense.bias"] = state[src + "self_attn.out_proj.bias"]
        for ours, theirs in (("norm1", "input_layernorm"), ("norm3", "post_attention_layernorm")):
            for p in ("weight", "bias"):
                out[f"{dst}{theirs}.{p}"] = state[f"{src}{ours}.{p}"]
        for ours, theirs in (("fc1", "dense_h_to_4h"), ("fc2", "dense_4h_to_h")):
            w = state[f"{src}ffn.{ours}.weight"]
            out[f"{dst}mlp.{theirs}.weight"] = w
            out[f"{dst}mlp.{theirs}.bias"] = state.get(f"{src}ffn.{ours}.bias", w.new_zeros(w.shape[0]))
    if not cfg.tie_embeddings:
        out["embed_out.weight"] = state["lm_head.weight"]
    return config, out


def _position_table(model: torch.nn.Module, n_positions: int) -> Tensor:
    """GPT-2's ``wpe`` (n_positions, D): what posformer's ``embed`` PE adds at positions ``0 … n-1``."""
    cfg, pe = model.cfg, rope_of(model)
    zeros = torch.zeros(1, n_positions, cfg.d_model, device=model.tok_emb.weight.device)
    if pe is None or "embed" not in pe.caps.hooks:
        return zeros[0]
    std = cfg.embedding_std
    positions = torch.arange(n_positions, device=zeros.device).unsqueeze(0)
    with torch.no_grad():
        return (pe.embed(zeros, positions) * std)[0]  # (x/std + table)·std - x, at x = 0


def to_gpt2(model: torch.nn.Module, state: dict[str, Tensor], n_positions: int | None) -> tuple[dict, dict]:
    cfg, pe = model.cfg, rope_of(model)
    limit = getattr(pe, "max_len", None) if pe is not None else None
    n = int(n_positions or limit or DEFAULT_POSITIONS)
    if limit is not None and n > limit:
        raise ConfigError(f"export_hf: n_positions={n} exceeds the PE's {limit} positions.")
    d = cfg.d_model
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **shared_config(cfg),
        "n_embd": d,
        "n_head": cfg.n_heads,
        "n_layer": cfg.n_layers,
        "n_inner": cfg.ffn_dim,
        "n_positions": n,
        "activation_function": cfg.activation,
        "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout,
        "bos_token_id": None,
        "eos_token_id": None,
    }

    def bias(key: str, size: int, ref: Tensor) -> Tensor:
        return state.get(key, ref.new_zeros(size))

    wte = state["tok_emb.weight"]
    out = {"transformer.wte.weight": wte, "transformer.wpe.weight": _position_table(model, n).to(wte.dtype)}
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (
        state["norm_f.weight"],
        state["norm_f.bias"],
    )
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (
            ("self_attn.qkv_proj", "attn.c_attn"),
            ("self_attn.out_proj", "attn.c_proj"),
            ("ffn.fc1", "mlp.c_fc"),
            ("ffn.fc2", "mlp.c_proj"),
        ):
            w = state[f"{src}{ours}.weight"]  # GPT-2's Conv1D stores (in, out)
            out[f"{dst}{theirs}.weight"] = w.t().contiguous()
            out[f"{dst}{theirs}.bias"] = bias(f"{src}{ours}.bias", w.shape[0], w)
        for ours, theirs in (("norm1", "ln_1"), ("norm3", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{dst}{theirs}.{p}"] = state[f"{src}{ours}.{p}"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return config, out


def from_neox(config: dict[str, Any], state: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    problems = (
        []
        if config.get("use_parallel_residual") is False
        else ["parallel residual blocks (use_parallel_residual=true)"]
    )
    if float(config.get("layer_norm_eps", LN_EPS)) != LN_EPS:
        problems.append(f"layer_norm_eps={config['layer_norm_eps']} (posformer's LayerNorm has {LN_EPS})")
    if config.get("hidden_act", "gelu") not in ("gelu", "relu"):
        problems.append(f"hidden_act={config['hidden_act']!r} (posformer: gelu or relu)")
    refuse("import_hf", problems)
    d, h, n = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    dh = d // h
    cfg = model_config(
        vocab_size=int(config["vocab_size"]),
        d_model=d,
        n_heads=h,
        n_layers=n,
        d_ff=int(config["intermediate_size"]),
        dropout=float(config.get("hidden_dropout", 0.0)),
        attn_dropout=float(config.get("attention_dropout", 0.0)),
        activation=config.get("hidden_act", "gelu"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bias=True,
        pe_options=rope_options(config, 0.25),
    )
    p = "gpt_neox."
    out = {"tok_emb.weight": state[p + "embed_in.weight"]}
    out["norm_f.weight"], out["norm_f.bias"] = (
        state[p + "final_layer_norm.weight"],
        state[p + "final_layer_norm.bias"],
    )
    for i in range(n):
        src, dst = f"{p}layers.{i}.", f"blocks.{i}."
        qkv = state[src + "attention.query_key_value.weight"]
        out[dst + "self_attn.qkv_proj.weight"] = qkv.view(h, 3, dh, d).transpose(0, 1).reshape(3 * d, d)
        qkv_b = state.get(src + "attention.query_key_value.bias", qkv.new_zeros(3 * d))
        out[dst + "self_attn.qkv_proj.bias"] = qkv_b.view(h, 3, dh).transpose(0, 1).reshape(3 * d)
        dense = state[src + "attention.dense.weight"]
        out[dst + "self_attn.out_proj.weight"] = dense
        out[dst + "self_attn.out_proj.bias"] = state.get(src + "attention.dense.bias", dense.new_zeros(d))
        for ours, theirs in (("norm1", "input_layernorm"), ("norm3", "post_attention_layernorm")):
            for q in ("weight", "bias"):
                out[f"{dst}{ours}.{q}"] = state[f"{src}{theirs}.{q}"]
        for ours, theirs in (("fc1", "dense_h_to_4h"), ("fc2", "dense_4h_to_h")):
            for q in ("weight", "bias"):
                out[f"{dst}ffn.{ours}.{q}"] = state[f"{src}mlp.{theirs}.{q}"]
    out["lm_head.weight"] = out["tok_emb.weight"] if cfg.tie_embeddings else state["embed_out.weight"]
    return cfg, out

"""Llama (``LlamaForCausalLM``; Mistral without a sliding window): posformer's RMSNorm + SwiGLU + RoPE
decoder (``model.norm=rmsnorm model.mlp=swiglu pe=rope``) in HF's names.

Grouped-query attention imports exactly: each key/value head is repeated for the query heads that share
it (HF's ``repeat_kv``), so posformer's full-head projection computes the same logits; the export writes
``num_key_value_heads = num_attention_heads``. posformer's one ``model.bias`` stands for Llama's
``attention_bias`` and ``mlp_bias``: a folder with only one of them imports with zero biases for the rest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posformer.interop.common import (
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

#: the architectures with Llama's block (Mistral's only without a sliding window)
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
LLAMA_MODEL_TYPES = ("llama", "mistral")
_PROJ = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def is_llama_block(cfg: ModelConfig) -> bool:
    """Whether a posformer config asks for Llama's block parts (RMSNorm or the SwiGLU MLP)."""
    return cfg.norm == "rmsnorm" or cfg.mlp == "swiglu"


def llama_problems(cfg: ModelConfig, pe: Any = None) -> list[str]:
    """What ``LlamaForCausalLM`` cannot express of a posformer decoder with RMSNorm or SwiGLU."""
    problems = []
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu":
        problems.append(
            f"model.norm={cfg.norm!r} with model.mlp={cfg.mlp!r} (Llama: rmsnorm + swiglu; GPT-NeoX: "
            "layernorm + mlp)"
        )
    if cfg.pe != ROTARY_PE:
        problems.append(f"pe={cfg.pe!r} with Llama's block (LlamaForCausalLM has RoPE)")
    elif pe is not None:
        problems += rope_problems(pe, cfg.n_heads)
        if pe.rotary_dim != pe.head_dim:
            problems.append("partial rotary dimensions (rotary_fraction < 1; Llama rotates every dimension)")
    return problems


# ------------------------------------------------------------------------------------------ export
def to_llama(model: torch.nn.Module, state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``LlamaForCausalLM``'s ``config.json`` fields and tensors of a posformer decoder's ``state``."""
    cfg, pe = model.cfg, rope_of(model)
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads
    state = half_layout(state, pe, h, dh)
    params, max_pos = hf_rope_parameters(pe)
    params.pop("partial_rotary_factor", None)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shared_config(cfg),
        "hidden_size": d,
        "num_attention_heads": h,
        "num_key_value_heads": h,
        "head_dim": dh,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(cfg.norm_eps),
        "attention_bias": bool(cfg.bias),
        "mlp_bias": bool(cfg.bias),
        "attention_dropout": cfg.attn_dropout,
        "max_position_embeddings": max_pos or 2048,
        "rope_parameters": params,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"]}
    for i in range(cfg.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for suffix in ("weight", "bias") if cfg.bias else ("weight",):
            fused = state[f"{src}self_attn.qkv_proj.{suffix}"]  # rows (3, H, Dh)
            for part, name in zip(fused.chunk(3, dim=0), _PROJ):
                out[f"{dst}self_attn.{name}.{suffix}"] = part
            out[f"{dst}self_attn.o_proj.{suffix}"] = state[f"{src}self_attn.out_proj.{suffix}"]
            for name in _MLP:
                out[f"{dst}mlp.{name}.{suffix}"] = state[f"{src}ffn.{name}.{suffix}"]
        out[f"{dst}input_layernorm.weight"] = state[f"{src}norm1.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = state[f"{src}norm3.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return config, out


# ------------------------------------------------------------------------------------------ import
def _import_problems(config: dict[str, Any], d: int, h: int, kv: int) -> list[str]:
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (posformer's swiglu gates with silu)")
    if int(config.get("head_dim") or d // h) * h != d:
        problems.append(f"head_dim={config['head_dim']} != hidden_size/num_attention_heads={d // h}")
    if h % kv:
        problems.append(f"num_key_value_heads={kv} not dividing num_attention_heads={h}")
    if config.get("sliding_window"):
        problems.append(f"sliding_window={config['sliding_window']} (posformer imports full attention)")
    if int(config.get("pretraining_tp", 1) or 1) != 1:
        problems.append(f"pretraining_tp={config['pretraining_tp']}")
    return problems


def _repeat_heads(t: Tensor, kv: int, rep: int) -> Tensor:
    """Key/value rows (KV·Dh, ...) -> (KV·rep·Dh, ...): each head repeated for its ``rep`` query heads."""
    return t.reshape(kv, -1, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])


def from_llama(config: dict[str, Any], state: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """posformer's ``(ModelConfig, state_dict)`` of a Llama folder's ``config.json`` and tensors."""
    d, h, n = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    kv = int(config.get("num_key_value_heads") or h)
    refuse(f"import_hf({(config.get('architectures') or ['llama'])[0]})", _import_problems(config, d, h, kv))
    attn_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    cfg = model_config(
        vocab_size=int(config["vocab_size"]),
        d_model=d,
        n_heads=h,
        n_layers=n,
        d_ff=int(config["intermediate_size"]),
        dropout=0.0,
        attn_dropout=float(config.get("attention_dropout", 0.0)),
        norm="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        mlp="swiglu",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bias=attn_bias or mlp_bias,
        pe_options=rope_options(config, 1.0),
    )
    out = {"tok_emb.weight": state["model.embed_tokens.weight"], "norm_f.weight": state["model.norm.weight"]}
    rep = h // kv
    for i in range(n):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        q, k, v = (state[f"{src}self_attn.{name}.weight"] for name in _PROJ)
        out[f"{dst}self_attn.qkv_proj.weight"] = torch.cat(
            [q, _repeat_heads(k, kv, rep), _repeat_heads(v, kv, rep)]
        )
        o = state[f"{src}self_attn.o_proj.weight"]
        out[f"{dst}self_attn.out_proj.weight"] = o
        for name in _MLP:
            out[f"{dst}ffn.{name}.weight"] = state[f"{src}mlp.{name}.weight"]
        if cfg.bias:
            zero = o.new_zeros(d)
            qb, kb, vb = (
                state.get(f"{src}self_attn.{name}.bias", zero[: t.shape[0]])
                for name, t in zip(_PROJ, (q, k, v))
            )
            out[f"{dst}self_attn.qkv_proj.bias"] = torch.cat(
                [qb, _repeat_heads(kb, kv, rep), _repeat_heads(vb, kv, rep)]
            )
            out[f"{dst}self_attn.out_proj.bias"] = state.get(f"{src}self_attn.o_proj.bias", zero)
            for name in _MLP:
                w = state[f"{src}mlp.{name}.weight"]
                out[f"{dst}ffn.{name}.bias"] = state.get(f"{src}mlp.{name}.bias", w.new_zeros(w.shape[0]))
        out[f"{dst}norm1.weight"] = state[f"{src}input_layernorm.weight"]
        out[f"{dst}norm3.weight"] = state[f"{src}post_attention_layernorm.weight"]
    out["lm_head.weight"] = out["tok_emb.weight"] if cfg.tie_embeddings else state["lm_head.weight"]
    return cfg, out

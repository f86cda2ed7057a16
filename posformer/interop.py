"""Hugging Face models in and out: a posformer decoder as a ``transformers`` model folder, and a local HF
folder as a posformer model (config, weights, tokenizer) to fine-tune and evaluate.

posformer's decoder block is pre-LN with ``nn.LayerNorm`` (eps 1e-5, weight and bias), a fused QKV
projection, an ``fc1 -> GELU|ReLU -> fc2`` feed-forward and an untied or tied ``lm_head`` without bias.
The HF architectures with exactly that block:

=========================== ===============================================================================
posformer                   HF
=========================== ===============================================================================
``pe=rope`` (any scaling    ``GPTNeoXForCausalLM`` with ``use_parallel_residual=false``: ``rotary_fraction``
HF knows, either layout)    is ``partial_rotary_factor``, ``base`` is ``rope_theta``, ``scaling`` is
                            ``rope_parameters`` (linear/PI, dynamic, YaRN, Llama 3, LongRoPE); an
                            ``interleaved`` layout is exported as ``half`` (q/k rows permuted)
``pe=nope``, ``learned``,   ``GPT2LMHeadModel``: its position table ``wpe`` is zero (NoPE), the learned
``sinusoidal``              table, or the sinusoids, as the model adds them (``n_positions`` rows)
=========================== ===============================================================================

A ``bias=false`` model is exported with zero biases (HF's MLPs always have them). Everything else is
refused in one line naming what HF cannot express: ALiBi, T5 and the other bias PEs, post-LN,
per-layer schedules, sinks, head subsets of RoPE, p-RoPE, scaled embeddings, encoder-decoder models.
Llama-family checkpoints (RMSNorm, gated SiLU MLP, no biases) are refused on import for the same
reason: posformer's block has neither, so no posformer model computes their logits.

:func:`export_hf` writes ``config.json`` + ``model.safetensors``; :func:`import_hf` reads a folder back as
``(ModelConfig, state_dict, tokenizer)``; :func:`hf_to_checkpoint` writes the imported model as a
posformer checkpoint for ``posformer-train init_from=<file>`` (fine-tuning with
``model.pe_options.scaling`` set: PI, YaRN, LongRoPE). Logits agree within 1e-5 both ways
(``tests/cli/test_hf_interop.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model
from posformer.model.knobs import model_knobs
from posformer.pe.registry import get_encoding_class
from posformer.pe.rope.hf import normalize_scaling
from posformer.pe.rope.layout import convert_qkv_state_dict
from posformer.runs import Run, load_run

__all__ = ["export_hf", "hf_problems", "hf_to_checkpoint", "import_hf"]

#: posformer scaling type -> HF ``rope_type``
HF_ROPE_TYPES = {
    "linear": "linear",
    "dynamic_ntk": "dynamic",
    "yarn": "yarn",
    "llama3": "llama3",
    "longrope": "longrope",
}
#: the one PE GPT-NeoX's rotary attention expresses (a table of another library's equivalents, like the
#: benchmark's); GPT-2's position table expresses every PE whose hooks act on the embeddings alone
ROTARY_PE = "rope"
#: posformer's LayerNorm epsilon (``nn.LayerNorm``'s default)
LN_EPS = 1e-5
#: rows of GPT-2's ``wpe`` for a PE without a table length (NoPE)
DEFAULT_POSITIONS = 2048


def _table_pe(name: str) -> bool:
    """Whether GPT-2's absolute position table expresses the PE ``name``: its hooks act on the embeddings
    alone (a learned or fixed table added to the tokens, or none)."""
    return get_encoding_class(name).capabilities.hooks <= {"embed"}


def _rope(model: torch.nn.Module) -> Any:
    return model.layer_pes.place("decoder")


def hf_problems(cfg: ModelConfig, pe: Any = None) -> list[str]:
    """What HF cannot express of a posformer model config (``pe``: the built PE, for its options);
    empty when :func:`export_hf` can write it exactly."""
    problems = []
    if cfg.kind != "decoder":
        problems.append("an encoder-decoder model (HF's causal LMs are decoder-only)")
    if not cfg.pre_ln:
        problems.append("post-LN blocks (model.norm_first=false)")
    if cfg.layers or cfg.layer_kinds:
        problems.append("a per-layer schedule (model.layers / model.layer_kinds)")
    if model_knobs(cfg.attention_knobs).active:
        problems.append("attention knobs (model.attention_knobs: qk_norm, output_gate, softcap, ssmax)")
    if cfg.scale_embedding:
        problems.append("scaled token embeddings (model.scale_embedding=true)")
    if cfg.pe != ROTARY_PE and not _table_pe(cfg.pe):
        problems.append(f"pe={cfg.pe!r} (HF's GPT-NeoX and GPT-2 have RoPE or an absolute position table)")
    if cfg.pe == ROTARY_PE and pe is not None:
        if pe.rotary_heads != cfg.n_heads:
            problems.append("RoPE on a subset of the heads (head_fraction < 1)")
        if pe.rotated_pairs != pe.rotary_dim // 2:
            problems.append("p-RoPE (proportion < 1)")
        kind = (pe.scaling or {}).get("type")
        if kind is not None and kind not in HF_ROPE_TYPES:
            problems.append(f"scaling.type={kind!r} (HF's rope types: {', '.join(HF_ROPE_TYPES.values())})")
    return problems


def _refuse(what: str, problems: list[str]) -> None:
    if problems:
        raise ConfigError(f"{what}: HF cannot express {'; '.join(problems)}.")


# ------------------------------------------------------------------------------------------ export
def _hf_rope_parameters(pe: Any) -> tuple[dict[str, Any], int | None]:
    """HF ``rope_parameters`` of a rotary PE and the ``max_position_embeddings`` its scaling needs."""
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": pe.base,
        "partial_rotary_factor": pe.rotary_dim / pe.head_dim,
    }
    scaling = dict(pe.scaling or {})
    if not scaling:
        return params, None
    kind = scaling.pop("type")
    params["rope_type"] = HF_ROPE_TYPES[kind]
    original = scaling.pop("original_max_len", None)
    for key in ("short_factor", "long_factor"):
        if key in scaling:
            scaling[key] = list(scaling[key])
    params.update(scaling)
    if kind == "dynamic_ntk":  # HF's dynamic NTK measures from max_position_embeddings
        return params, original
    if original is not None:
        params["original_max_position_embeddings"] = original
        return params, int(original * float(scaling.get("factor", 1.0)))
    return params, None


def _shared_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "torch_dtype": "float32",
    }


def _neox(model: torch.nn.Module, state: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg, pe = model.cfg, _rope(model)
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads
    if pe.layout != "half":
        state = convert_qkv_state_dict(
            state, n_heads=h, head_dim=dh, rotary_dim=pe.rotary_dim, src=pe.layout, dst="half"
        )
    params, max_pos = _hf_rope_parameters(pe)
    config = {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        **_shared_config(cfg),
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
    cfg, pe = model.cfg, _rope(model)
    zeros = torch.zeros(1, n_positions, cfg.d_model, device=model.tok_emb.weight.device)
    if pe is None or "embed" not in pe.caps.hooks:
        return zeros[0]
    std = cfg.embedding_std
    positions = torch.arange(n_positions, device=zeros.device).unsqueeze(0)
    with torch.no_grad():
        return (pe.embed(zeros, positions) * std)[0]  # (x/std + table)·std - x, at x = 0


def _gpt2(model: torch.nn.Module, state: dict[str, Tensor], n_positions: int | None) -> tuple[dict, dict]:
    cfg, pe = model.cfg, _rope(model)
    limit = getattr(pe, "max_len", None) if pe is not None else None
    n = int(n_positions or limit or DEFAULT_POSITIONS)
    if limit is not None and n > limit:
        raise ConfigError(f"export_hf: n_positions={n} exceeds the PE's {limit} positions.")
    d = cfg.d_model
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **_shared_config(cfg),
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


def export_hf(
    run_or_model: Run | torch.nn.Module | str | Path, folder: str | Path, *, n_positions: int | None = None
) -> Path:
    """Write a posformer decoder (a :class:`~posformer.runs.Run`, a run dir or checkpoint, or the model)
    to ``folder`` as a ``transformers`` model (``config.json``, ``model.safetensors``) whose logits equal
    posformer's. RoPE models become GPT-NeoX, NoPE/learned/sinusoidal ones GPT-2 (``n_positions``: rows of
    its position table; default the PE's limit, else 2048). Raises :class:`ConfigError` naming what HF
    cannot express."""
    from safetensors.torch import save_file

    if isinstance(run_or_model, str | Path):
        run_or_model = load_run(run_or_model)
    model = run_or_model.model if isinstance(run_or_model, Run) else run_or_model
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"export_hf: {type(model).__name__} is not a posformer model (no ModelConfig cfg).")
    pe = _rope(model) if cfg.kind == "decoder" and not cfg.layers else None
    _refuse("export_hf", hf_problems(cfg, pe))
    if any(getattr(b.self_attn, "sinks", None) is not None for b in model.blocks):
        _refuse("export_hf", ["attention sinks"])
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    config, tensors = _neox(model, state) if cfg.pe == ROTARY_PE else _gpt2(model, state, n_positions)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# ------------------------------------------------------------------------------------------ import
def _read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"import_hf: {str(folder)!r} has no config.json; pass a transformers model folder.")
    config = json.loads(config_path.read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"import_hf: {str(folder)!r} has no *.safetensors weights (save with safe_serialization)."
        )
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state


def _neox_rope_options(config: dict[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    base = float(params.pop("rope_theta", config.get("rotary_emb_base", config.get("rope_theta", 10000.0))))
    fraction = float(params.pop("partial_rotary_factor", config.get("rotary_pct", 0.25)))
    options: dict[str, Any] = {"base": base}
    if fraction != 1.0:
        options["rotary_fraction"] = fraction
    kind = params.get("rope_type", params.get("type"))
    if kind == "dynamic" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.get("max_position_embeddings")
    scaling = normalize_scaling(params, "rope", base=base)
    if scaling:
        options["scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    return options


def _from_neox(config: dict[str, Any], state: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    problems = (
        []
        if config.get("use_parallel_residual") is False
        else ["parallel residual blocks (use_parallel_residual=true)"]
    )
    if float(config.get("layer_norm_eps", LN_EPS)) != LN_EPS:
        problems.append(f"layer_norm_eps={config['layer_norm_eps']} (posformer's LayerNorm has {LN_EPS})")
    if config.get("hidden_act", "gelu") not in ("gelu", "relu"):
        problems.append(f"hidden_act={config['hidden_act']!r} (posformer: gelu or relu)")
    _refuse("import_hf", problems)
    d, h, n = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["num_hidden_layers"])
    dh = d // h
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=int(config["vocab_size"]),
        d_model=d,
        n_heads=h,
        n_layers=n,
        d_ff=int(config["intermediate_size"]),
        dropout=float(config.get("hidden_dropout", 0.0)),
        attn_dropout=float(config.get("attention_dropout", 0.0)),
        activation=config.get("hidden_act", "gelu"),
        norm_first=True,
        scale_embedding=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bias=True,
        pe="rope",
        pe_options=_neox_rope_options(config),
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


def _refuse_architecture(arch: str, config: dict[str, Any]) -> None:
    if arch in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ) or config.get("model_type") in ("llama", "mistral", "qwen2", "qwen3"):
        _refuse(
            f"import_hf({arch})",
            ["RMSNorm and a gated SiLU MLP (SwiGLU): posformer's block has LayerNorm and a GELU/ReLU MLP"],
        )
    _refuse(
        f"import_hf({arch})",
        ["this architecture (posformer imports GPTNeoXForCausalLM with use_parallel_residual=false)"],
    )


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, Tensor], Any]:
    """A local ``transformers`` folder as posformer's ``(ModelConfig, state_dict, tokenizer)``: weights,
    ``rope_parameters``/``rope_scaling`` (as ``model.pe_options``) and the folder's tokenizer (``None`` when
    it has none). ``build_model(cfg).load_state_dict(state)`` gives the HF model's logits."""
    folder = Path(folder)
    config, state = _read_folder(folder)
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    if arch != "GPTNeoXForCausalLM":
        _refuse_architecture(arch, config)
    cfg, out = _from_neox(config, state)
    build_model(cfg).load_state_dict(out)  # every key and shape, before anyone trains from it
    return cfg, out, _tokenizer(folder)


def _tokenizer(folder: Path) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def hf_to_checkpoint(folder: str | Path, path: str | Path, *, scaling: dict[str, Any] | None = None) -> Path:
    """Write the HF model at ``folder`` as a posformer checkpoint at ``path`` for ``posformer-train
    init_from=<path>`` (the training config gives the same ``model.*``; its ``model.pe_options.scaling``,
    e.g. ``{type: yarn, factor: 4, original_max_len: 2048}``, is the context extension to fine-tune with).
    ``scaling`` replaces the imported one in the checkpoint's recorded config."""
    cfg, state, _ = import_hf(folder)
    if scaling is not None:
        cfg = ModelConfig(**{**cfg.to_dict(), "pe_options": {**cfg.pe_options, "scaling": dict(scaling)}})
    ckpt = {
        "state_dict": {f"model.{k}": v.contiguous() for k, v in state.items()},
        "hyper_parameters": {"model": cfg.to_dict()},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path

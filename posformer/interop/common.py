"""What the Hugging Face formats share: the rotary parameters both ways, reading a folder, its tokenizer,
and the one-line refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.model import ModelConfig
from posformer.model.knobs import model_knobs
from posformer.pe.rope.hf import normalize_scaling
from posformer.pe.rope.layout import convert_qkv_state_dict

#: posformer scaling type -> HF ``rope_type``
HF_ROPE_TYPES = {
    "linear": "linear",
    "dynamic_ntk": "dynamic",
    "yarn": "yarn",
    "llama3": "llama3",
    "longrope": "longrope",
}
#: the one PE GPT-NeoX's and Llama's rotary attention express (a table of another library's equivalents,
#: like the benchmark's)
ROTARY_PE = "rope"
#: posformer's LayerNorm epsilon (``nn.LayerNorm``'s default)
LN_EPS = 1e-5


def rope_of(model: torch.nn.Module) -> Any:
    """The decoder's PE module (``None`` when it has none)."""
    return model.layer_pes.place("decoder")


def refuse(what: str, problems: list[str]) -> None:
    """One :class:`ConfigError` line naming everything HF cannot express."""
    if problems:
        raise ConfigError(f"{what}: HF cannot express {'; '.join(problems)}.")


def shared_problems(cfg: ModelConfig) -> list[str]:
    """What no HF causal LM posformer writes expresses, whatever the block."""
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
    return problems


def rope_problems(pe: Any, n_heads: int) -> list[str]:
    """What HF's rotary attention cannot express of a built rotary PE: a head subset, p-RoPE, a scaling
    type HF lacks."""
    problems = []
    if pe.rotary_heads != n_heads:
        problems.append("RoPE on a subset of the heads (head_fraction < 1)")
    if pe.rotated_pairs != pe.rotary_dim // 2:
        problems.append("p-RoPE (proportion < 1)")
    kind = (pe.scaling or {}).get("type")
    if kind is not None and kind not in HF_ROPE_TYPES:
        problems.append(f"scaling.type={kind!r} (HF's rope types: {', '.join(HF_ROPE_TYPES.values())})")
    return problems


def hf_rope_parameters(pe: Any) -> tuple[dict[str, Any], int | None]:
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


def shared_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "torch_dtype": "float32",
    }


def read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
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


def rope_options(config: dict[str, Any], default_fraction: float) -> dict[str, Any]:
    """``model.pe_options`` of an HF config's rotary settings (``rope_parameters`` or ``rope_scaling``)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    base = float(params.pop("rope_theta", config.get("rotary_emb_base", config.get("rope_theta", 10000.0))))
    fraction = float(params.pop("partial_rotary_factor", config.get("rotary_pct", default_fraction)))
    options: dict[str, Any] = {"base": base}
    if fraction != 1.0:
        options["rotary_fraction"] = fraction
    kind = params.get("rope_type", params.get("type"))
    if kind == "dynamic" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings")
    if (
        kind == "longrope"
        and params.get("factor") is None
        and original
        and config.get("max_position_embeddings")
    ):
        params["factor"] = config["max_position_embeddings"] / original  # as HF derives it
    scaling = normalize_scaling(params, "rope", base=base)
    if scaling:
        options["scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    return options


def tokenizer_of(folder: Path) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def model_config(**fields: Any) -> ModelConfig:
    """A decoder-only, pre-LN, unscaled-embedding rope :class:`ModelConfig` of an imported model."""
    return ModelConfig(kind="decoder", norm_first=True, scale_embedding=False, pe=ROTARY_PE, **fields)


def half_layout(state: dict[str, Tensor], pe: Any, n_heads: int, head_dim: int) -> dict[str, Tensor]:
    """A decoder's ``state`` with its q/k projections in HF's rotary layout (``half``: pairs
    ``(i, i + D/2)``), converted from the rotary PE ``pe``'s own layout; as it is when already ``half``."""
    if pe.layout == "half":
        return state
    return convert_qkv_state_dict(
        state, n_heads=n_heads, head_dim=head_dim, rotary_dim=pe.rotary_dim, src=pe.layout, dst="half"
    )

"""Hugging Face models in and out: a posformer decoder as a ``transformers`` model folder, and a local HF
folder as a posformer model (config, weights, tokenizer) to fine-tune and evaluate.

posformer's decoder block is pre-LN with a fused QKV projection and an untied or tied ``lm_head``
without bias; its norm is ``nn.LayerNorm`` (eps 1e-5, weight and bias) or, with ``model.norm=rmsnorm``,
``nn.RMSNorm``; its feed-forward ``fc1 -> GELU|ReLU -> fc2`` or, with ``model.mlp=swiglu``, Llama's
gated SiLU MLP. The HF architectures with exactly those blocks:

=========================== ===============================================================================
posformer                   HF
=========================== ===============================================================================
``pe=rope`` (any scaling    ``GPTNeoXForCausalLM`` with ``use_parallel_residual=false``: ``rotary_fraction``
HF knows, either layout)    is ``partial_rotary_factor``, ``base`` is ``rope_theta``, ``scaling`` is
                            ``rope_parameters`` (linear/PI, dynamic, YaRN, Llama 3, LongRoPE); an
                            ``interleaved`` layout is exported as ``half`` (q/k rows permuted)
``pe=rope``,                ``LlamaForCausalLM`` (and ``MistralForCausalLM`` without a sliding window on
``norm=rmsnorm``,           import): ``rms_norm_eps`` is ``model.norm_eps``, ``rope_parameters`` as for
``mlp=swiglu``              GPT-NeoX (full rotary dimensions); grouped-query attention imports with the
                            key/value heads repeated (exact), the export writes one per head
``pe=nope``, ``learned``,   ``GPT2LMHeadModel``: its position table ``wpe`` is zero (NoPE), the learned
``sinusoidal``              table, or the sinusoids, as the model adds them (``n_positions`` rows)
=========================== ===============================================================================

A ``bias=false`` model is exported with zero biases (HF's MLPs always have them). Everything else is
refused in one line naming what HF cannot express: ALiBi, T5 and the other bias PEs, post-LN,
per-layer schedules, sinks, head subsets of RoPE, p-RoPE, scaled embeddings, encoder-decoder models.
Qwen2/3 and other architectures are refused on import, naming the architecture.

:func:`export_hf` writes ``config.json`` + ``model.safetensors``; :func:`import_hf` reads a folder back as
``(ModelConfig, state_dict, tokenizer)``; :func:`hf_to_checkpoint` writes the imported model as a
posformer checkpoint for ``posformer-train init_from=<file>`` (fine-tuning with
``model.pe_options.scaling`` set: PI, YaRN, LongRoPE). Logits agree within 1e-5 both ways
(``tests/cli/test_hf_interop.py``, ``tests/cli/test_hf_llama.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.interop.common import HF_ROPE_TYPES, ROTARY_PE, read_folder, refuse, rope_of, shared_problems
from posformer.interop.common import tokenizer_of as _tokenizer
from posformer.interop.llama import (
    LLAMA_ARCHITECTURES,
    LLAMA_MODEL_TYPES,
    from_llama,
    is_llama_block,
    llama_problems,
    to_llama,
)
from posformer.interop.neox import from_neox, neox_problems, to_gpt2, to_neox
from posformer.model import ModelConfig, build_model
from posformer.runs import Run, load_run

__all__ = ["HF_ROPE_TYPES", "export_hf", "hf_problems", "hf_to_checkpoint", "import_hf"]


def hf_problems(cfg: ModelConfig, pe: Any = None) -> list[str]:
    """What HF cannot express of a posformer model config (``pe``: the built PE, for its options);
    empty when :func:`export_hf` can write it exactly."""
    block = llama_problems if is_llama_block(cfg) else neox_problems
    return shared_problems(cfg) + block(cfg, pe)


# ------------------------------------------------------------------------------------------ export
def export_hf(
    run_or_model: Run | torch.nn.Module | str | Path, folder: str | Path, *, n_positions: int | None = None
) -> Path:
    """Write a posformer decoder (a :class:`~posformer.runs.Run`, a run dir or checkpoint, or the model)
    to ``folder`` as a ``transformers`` model (``config.json``, ``model.safetensors``) whose logits equal
    posformer's. RMSNorm + SwiGLU + RoPE models become Llama, other RoPE models GPT-NeoX,
    NoPE/learned/sinusoidal ones GPT-2 (``n_positions``: rows of its position table; default the PE's
    limit, else 2048). Raises :class:`ConfigError` naming what HF cannot express."""
    import json

    from safetensors.torch import save_file

    if isinstance(run_or_model, str | Path):
        run_or_model = load_run(run_or_model)
    model = run_or_model.model if isinstance(run_or_model, Run) else run_or_model
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"export_hf: {type(model).__name__} is not a posformer model (no ModelConfig cfg).")
    pe = rope_of(model) if cfg.kind == "decoder" and not cfg.layers else None
    refuse("export_hf", hf_problems(cfg, pe))
    if any(getattr(b.self_attn, "sinks", None) is not None for b in model.blocks):
        refuse("export_hf", ["attention sinks"])
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if is_llama_block(cfg):
        config, tensors = to_llama(model, state)
    elif cfg.pe == ROTARY_PE:
        config, tensors = to_neox(model, state)
    else:
        config, tensors = to_gpt2(model, state, n_positions)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# ------------------------------------------------------------------------------------------ import
def _is_llama(arch: str, config: dict[str, Any]) -> bool:
    return arch in LLAMA_ARCHITECTURES or (
        arch not in ("GPTNeoXForCausalLM",) and config.get("model_type") in LLAMA_MODEL_TYPES
    )


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, Tensor], Any]:
    """A local ``transformers`` folder as posformer's ``(ModelConfig, state_dict, tokenizer)``: weights,
    ``rope_parameters``/``rope_scaling`` (as ``model.pe_options``) and the folder's tokenizer (``None`` when
    it has none). ``build_model(cfg).load_state_dict(state)`` gives the HF model's logits."""
    folder = Path(folder)
    config, state = read_folder(folder)
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    if arch == "GPTNeoXForCausalLM":
        cfg, out = from_neox(config, state)
    elif _is_llama(arch, config):
        cfg, out = from_llama(config, state)
    else:
        refuse(
            f"import_hf({arch})",
            [
                "this architecture (posformer imports GPTNeoXForCausalLM with use_parallel_residual=false "
                "and LlamaForCausalLM)"
            ],
        )
    build_model(cfg).load_state_dict(out)  # every key and shape, before anyone trains from it
    return cfg, out, _tokenizer(folder)


def hf_to_checkpoint(folder: str | Path, path: str | Path, *, scaling: dict[str, Any] | None = None) -> Path:
    """Write the HF model at ``folder`` as a posformer checkpoint at ``path`` for ``posformer-train
    init_from=<path>`` (the training config gives the same ``model.*``; its ``model.pe_options.scaling``,
    e.g. ``{type: yarn, factor: 4, original_max_len: 2048}``, is the context extension to fine-tune with).
    ``scaling`` replaces the imported one in the checkpoint's recorded config. The folder's tokenizer,
    when it has one, is saved beside the checkpoint in ``tokenizer/`` (``data.tokenizer`` can name it)."""
    cfg, state, tokenizer = import_hf(folder)
    if scaling is not None:
        cfg = ModelConfig(**{**cfg.to_dict(), "pe_options": {**cfg.pe_options, "scaling": dict(scaling)}})
    ckpt = {
        "state_dict": {f"model.{k}": v.contiguous() for k, v in state.items()},
        "hyper_parameters": {"model": cfg.to_dict()},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path.parent / "tokenizer"))
    return path

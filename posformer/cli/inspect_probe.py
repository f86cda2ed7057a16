"""``posformer-inspect attention_probe=true``: the attention probe of a whole model
(:mod:`posformer.eval.attention_probe`: first-token mass per layer and head, entropy against distance).

The model is the checkpoint's (``ckpt=`` / ``run=``, trained weights) or one built from ``model`` at its
initial weights (``seed``). Its input: ``probe_batch`` sequences of ``max_len`` tokens, drawn uniformly
from the vocabulary (``probe_source=random``, never the pad token) or the first validation sequences of
the checkpoint's training data (``probe_source=data``, a checkpoint only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from posformer.devices import torch_device
from posformer.errors import ConfigError
from posformer.eval.attention_probe import attention_probabilities, probe_stats, write_probe
from posformer.model import ModelConfig, build_model

SOURCES = ("random", "data")


def inspected_model_config(cfg: DictConfig) -> ModelConfig:
    """``cfg.model`` as a checked :class:`ModelConfig` (a vocabulary of at least 8: the probes' tokens);
    an unresolvable value (``pe=custom`` without ``model.pe``) is one :class:`ConfigError`."""
    try:
        fields = OmegaConf.to_container(cfg.model, resolve=True)
    except Exception as exc:  # a missing value, e.g. pe=custom without model.pe
        raise ConfigError(
            f"the model config cannot be resolved ({str(exc).splitlines()[0]}); with pe=custom name the "
            "PE by import path: model.pe=module:Class."
        ) from None
    vocab = max(int(fields.get("vocab_size") or 0), 8)
    return ModelConfig(**{**fields, "vocab_size": vocab})  # its checks: one error each


def check_probe_config(cfg: DictConfig) -> None:
    """Refuse bad probe keys in one line, before any work."""
    if not cfg.get("attention_probe", False):
        return
    batch, source = cfg.get("probe_batch", 4), cfg.get("probe_source", "random")
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1024:
        raise ConfigError(f"probe_batch={batch!r} must be an integer from 1 to 1024 (sequences probed).")
    if source not in SOURCES:
        raise ConfigError(f"probe_source={source!r} is unknown; valid: {', '.join(SOURCES)}.")
    if source == "data" and not (cfg.get("ckpt") or cfg.get("run")):
        raise ConfigError(
            "probe_source=data reads the training data of a checkpoint; add ckpt=<file.ckpt> or run=<run "
            "dir>, or use probe_source=random."
        )


def _model(cfg: DictConfig, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The probed model and its checkpoint (``None`` for one built from ``cfg.model``)."""
    from posformer.checkpoints import load_checkpoint

    path = cfg.get("ckpt") or None
    if cfg.get("run"):
        from posformer.runs import find_run_checkpoint

        path = find_run_checkpoint(Path(str(cfg.run)).expanduser(), "last")
    if path is not None:
        loaded = load_checkpoint(path, map_location="cpu")
        return loaded.model.eval().to(device), loaded
    mc = inspected_model_config(cfg)
    torch.manual_seed(int(cfg.seed))
    with torch.device("cpu"):
        model = build_model(mc)
    return model.eval().to(device), None


def _ids(cfg: DictConfig, model: torch.nn.Module, loaded: Any, device: torch.device) -> torch.Tensor:
    """(probe_batch, max_len) token ids (module docstring)."""
    b, t = int(cfg.get("probe_batch", 4)), int(cfg.max_len)
    if cfg.get("probe_source", "random") == "data":
        from posformer.eval.run import build_data

        dm = build_data(loaded, {})
        rows: list[torch.Tensor] = []
        for batch in dm.val_dataloader():
            rows += list(batch["input_ids"])
            if len(rows) >= b:
                break
        ids = torch.stack([r[:t] for r in rows[:b]])
        if ids.shape[1] < t:
            raise ConfigError(
                f"max_len={t} is longer than the data's validation sequences ({ids.shape[1]} tokens); "
                f"use max_len={ids.shape[1]} or less."
            )
        return ids.to(device)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    vocab, pad = int(model.cfg.vocab_size), int(model.cfg.pad_id)
    ids = torch.randint(0, vocab - 1, (b, t), generator=gen)
    return (ids + (ids >= pad).long()).to(device)  # every id but the pad token


def probe_section(
    cfg: DictConfig, out_dir: Path, console: Console, result: dict[str, Any], title: str
) -> None:
    """Run the probe, print its per-layer table and write its files (``result['paths']``)."""
    device = torch_device(cfg.get("device", "auto"))
    model, loaded = _model(cfg, device)
    ids = _ids(cfg, model, loaded, device)
    stats = probe_stats(attention_probabilities(model, ids))
    table = Table(title="attention probe", caption="first-token mass: mean over queries i >= 1 and heads")
    table.add_column("layer", justify="right")
    table.add_column("first-token mass", justify="right")
    table.add_column("entropy, last distance bin (nats)", justify="right")
    for layer, mass in enumerate(stats["first_token_mass_by_layer"]):
        table.add_row(str(layer), f"{mass:.3f}", f"{stats['entropy'][layer][-1]:.3f}")
    console.print(table)
    meta = {"source": cfg.get("probe_source", "random"), "batch": int(ids.shape[0]), "title": title}
    result["attention_probe"] = {**meta, **stats}
    result["paths"] += write_probe(stats, out_dir, title, meta)

"""Checkpoint averaging (Vaswani et al. 2017 §6.1: the base model averages the last 5 checkpoints,
written at 10-minute intervals; the big model the last 20).

:func:`average_checkpoints` takes Lightning ``.ckpt`` files, averages every floating-point entry of
their ``state_dict`` (the parameter mean; integer buffers must agree and are copied) and writes a new
checkpoint holding the mean weights and the hyper-parameters of the last input, so
``Seq2SeqModule.load_from_checkpoint(out)`` (or ``LanguageModelModule``) loads it. Optimizer and loop
states are dropped: the result is for evaluation, not for resuming training.

Command line: ``python -m posformer.eval.averaging OUT.ckpt IN1.ckpt IN2.ckpt ...`` or
``python -m posformer.eval.averaging OUT.ckpt --dir RUN/checkpoints --last 5``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from posformer.errors import CheckpointError

#: checkpoint entries that describe training progress and make no sense for averaged weights
_DROP = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "posformer_rng")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on CPU, with clear errors."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist.")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors have many types
        raise CheckpointError(
            f"cannot load checkpoint {str(p)!r} with torch.load(weights_only=True): {type(exc).__name__}: "
            f"{str(exc)[:300]}"
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{str(p)!r} is not a Lightning checkpoint (no 'state_dict' entry).")
    return ckpt


def _step(path: Path) -> int:
    """Training step of a checkpoint: from its ``global_step``, else from ``step<N>`` in the file name."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:  # noqa: BLE001 - fall back to the name
        m = re.search(r"step[=_-]?(\d+)", path.name)
        return int(m.group(1)) if m else -1


def last_checkpoints(directory: str | Path, n: int, up_to_step: int | None = None) -> list[Path]:
    """The ``n`` checkpoints of ``directory`` (recursively) with the highest training step, oldest first.

    ``last.ckpt`` (Lightning's copy of the newest checkpoint) is skipped when other checkpoints
    exist, and so is any checkpoint whose step another one already has. ``up_to_step``: only
    checkpoints at or before that step (to compare runs at an equal number of updates).
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist.")
    if n < 1:
        raise CheckpointError(f"average the last n={n} checkpoints: n must be >= 1.")
    files = sorted(d.rglob("*.ckpt"))
    named = [f for f in files if not f.name.startswith("last")] or files
    by_step: dict[int, Path] = {}
    for f in named:
        by_step.setdefault(_step(f), f)
    if not by_step:
        raise CheckpointError(f"no .ckpt files under {str(d)!r}.")
    steps = sorted(by_step)
    if up_to_step is not None:
        steps = [s for s in steps if s <= up_to_step]
    if len(steps) < n:
        where = f" at or before step {up_to_step}" if up_to_step is not None else ""
        raise CheckpointError(
            f"asked to average the last {n} checkpoints{where}, but {str(d)!r} holds {len(steps)} distinct "
            f"ones (steps {sorted(by_step)}); lower the count or save more often "
            "(callbacks.periodic_checkpoint)."
        )
    return [by_step[s] for s in steps[-n:]]


def average_state_dicts(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mean of floating-point tensors (accumulated in float64); other tensors must be equal."""
    if not states:
        raise CheckpointError("no checkpoints to average.")
    keys = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if set(s) != set(keys):
            diff = sorted(set(s) ^ set(keys))[:5]
            raise CheckpointError(
                f"checkpoint {i} has different parameters than checkpoint 0 (e.g. {diff}); "
                "only checkpoints of one model can be averaged."
            )
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ts = [s[k] for s in states]
        if any(t.shape != ts[0].shape for t in ts):
            raise CheckpointError(
                f"parameter {k!r} has shapes {[tuple(t.shape) for t in ts]} across checkpoints."
            )
        if ts[0].is_floating_point():
            acc = torch.zeros(ts[0].shape, dtype=torch.float64)
            for t in ts:
                acc += t.double()
            out[k] = (acc / len(ts)).to(ts[0].dtype)
        else:
            if any(not torch.equal(t, ts[0]) for t in ts):
                raise CheckpointError(
                    f"non-float entry {k!r} differs between checkpoints; cannot average it."
                )
            out[k] = ts[-1].clone()
    return out


def average_checkpoints(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Average the weights of ``paths`` into a new Lightning checkpoint ``out``; returns ``out``."""
    if not paths:
        raise CheckpointError("average_checkpoints needs at least one checkpoint.")
    ckpts = [load_checkpoint(p) for p in paths]
    result = {k: v for k, v in ckpts[-1].items() if k not in _DROP}
    result["state_dict"] = average_state_dicts([c["state_dict"] for c in ckpts])
    result["averaged_from"] = [str(p) for p in paths]
    result["averaged_steps"] = [int(c.get("global_step", -1)) for c in ckpts]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Average Lightning checkpoints (parameter mean).")
    ap.add_argument("out", help="output .ckpt")
    ap.add_argument("inputs", nargs="*", help="input .ckpt files")
    ap.add_argument("--dir", help="take the last --last checkpoints of this directory")
    ap.add_argument("--last", type=int, default=5)
    args = ap.parse_args(argv)
    paths = list(args.inputs) + (last_checkpoints(args.dir, args.last) if args.dir else [])
    out = average_checkpoints(paths, args.out)
    print(f"averaged {len(paths)} checkpoints -> {out}")
    for p in paths:
        print(f"  {p}")


if __name__ == "__main__":
    main()

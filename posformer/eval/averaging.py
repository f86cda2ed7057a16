"""Checkpoint averaging (Vaswani et al. 2017 §6.1: the base model averages the last 5 checkpoints,
written at 10-minute intervals; the big model the last 20).

:func:`average_checkpoints` takes Lightning ``.ckpt`` files, averages every floating-point entry of
their ``state_dict`` (the parameter mean; integer buffers must agree and are copied) and writes a new
checkpoint holding the mean weights and the hyper-parameters of the last input, so
``Seq2SeqModule.load_from_checkpoint(out)`` (or ``LanguageModelModule``) loads it. Optimizer and loop
states are dropped: the result is for evaluation, not for resuming training.

:func:`~posformer.checkpoints.last_checkpoints` (re-exported here) picks the checkpoints to average.

Command line: ``python -m posformer.eval.averaging OUT.ckpt IN1.ckpt IN2.ckpt ...`` or
``python -m posformer.eval.averaging OUT.ckpt --dir RUN/checkpoints --last 5``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from posformer.checkpoints import last_checkpoints, read_checkpoint
from posformer.errors import CheckpointError
from posformer.io import atomic_torch_save

__all__ = ["average_checkpoints", "average_state_dicts", "last_checkpoints"]

#: checkpoint entries that describe training progress and make no sense for averaged weights
_DROP = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "posformer_rng")


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
    ckpts = [read_checkpoint(p) for p in paths]  # weights_only=True, CRC-checked
    result = {k: v for k, v in ckpts[-1].items() if k not in _DROP}
    result["state_dict"] = average_state_dicts([c["state_dict"] for c in ckpts])
    result["averaged_from"] = [str(p) for p in paths]
    result["averaged_steps"] = [int(c.get("global_step", -1)) for c in ckpts]
    out = Path(out)
    atomic_torch_save(result, out)
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

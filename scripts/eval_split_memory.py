"""``posformer-eval`` at a length one process cannot hold, completed with the window split over two.

Each device of a context-parallel evaluation has its own memory; on the CPU this script stands in for
that with a cap on every process's data segment (``RLIMIT_DATA``, inherited by the processes
``eval.context_parallel`` spawns), so one process that needs more than the cap runs out of memory
where two processes, each holding half of the window, do not. It writes a run dir (a decoder of
``--d-model`` width, random weights: memory does not depend on training), a character corpus whose
validation half holds one window of ``--length``, then runs ``posformer-eval`` at ``--length`` with
``eval.context_parallel=1`` and ``=2`` under the same cap, and prints each exit status and last line.

    python scripts/eval_split_memory.py --length 65536 --cap-mb 1100 [--d-model 256 --heads 8 --layers 2]

The cap counts the whole process (an imported posformer, torch and Lightning take ~420 MB of it
before any window); ``--cap-mb`` is chosen between what one process and what each of two need.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf


def write_run(root: Path, args: argparse.Namespace) -> Path:
    """A run dir with ``checkpoints/last.ckpt`` (random weights) and ``config.yaml`` over a text of
    ``args.length + 1`` characters; returns the run dir."""
    from posformer.data import build_datamodule
    from posformer.lit import LanguageModelModule
    from posformer.model import ModelConfig

    text = root / "text.txt"
    line = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n"
    text.write_text(line * (3 * args.length // len(line)))  # the validation half holds one window
    data_cfg = {
        "name": "text",
        "path": str(text),
        "block_size": 64,
        "val_fraction": 0.5,
        "cache_dir": str(root / "cache"),
    }
    dm = build_datamodule(data_cfg, "decoder", 0)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(0)
    model = ModelConfig(
        kind="decoder",
        vocab_size=dm.vocab_size,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        d_ff=4 * args.d_model,
        dropout=0.0,
        pe=args.pe,
        attention_chunk_mb=args.attention_chunk_mb,
    ).to_dict()
    module = LanguageModelModule(model=model, data={"task_type": "lm", "train_length": 64})
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save(
        {"hyper_parameters": dict(module.hparams), "state_dict": module.eval().state_dict()},
        run / "checkpoints" / "last.ckpt",
    )
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"seed": 0, "data": data_cfg}))
    return run


def capped(cap_mb: int) -> None:
    """Runs in the child before ``exec``: the data-segment cap every process of the evaluation inherits."""
    cap = cap_mb * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))


def evaluate(run: Path, out: Path, args: argparse.Namespace, parallel: int) -> tuple[int, str]:
    """``posformer-eval`` of ``run`` at ``args.length`` split over ``parallel`` processes, under the cap:
    ``(exit status, last line of its output)``."""
    command = [
        sys.executable,
        "-m",
        "posformer.cli.evaluate",
        f"eval.checkpoints=[{run / 'checkpoints' / 'last.ckpt'}]",
        f"eval.lengths=[{args.length}]",
        "eval.modes=[nonoverlap]",
        "eval.batch_tokens=1",
        f"eval.n_tokens={args.length}",
        "eval.max_batches=1",
        f"eval.context_parallel={parallel}",
        "trainer=cpu",
        f"eval.output_dir={out}",
        f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, preexec_fn=lambda: capped(args.cap_mb)
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--cap-mb", type=int, default=1100, help="each process's data segment, MiB")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pe", default="rope")
    parser.add_argument("--attention-chunk-mb", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = write_run(Path(tmp), args)
        for parallel in (1, 2):
            code, last = evaluate(run, Path(tmp) / f"eval_p{parallel}", args, parallel)
            cap = f"{args.cap_mb} MiB per process"
            print(f"eval.context_parallel={parallel} under {cap}: exit {code}: {last}")


if __name__ == "__main__":
    main()

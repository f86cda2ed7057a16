"""Peak memory of one training step with the sequence split across P processes (context parallelism).

Each process runs one forward and backward of a decoder over its T/P tokens of a batch of T tokens
(``posformer.model.parallel``; gloo on the CPU, nccl on CUDA with one GPU per process) and measures the
step's peak with ``posformer.utils.memory.MemoryMeter`` (the CPU: the process's resident peak above its
state before the step; CUDA: allocated memory), and the bytes autograd saved for the backward (the
activations, counted per storage: what the allocator and the communication buffers do not blur). P=1
runs unsplit in one process. The activations a step
keeps grow with T/P, so at long T the per-process peak of P=2 is about half that of P=1.

``--eval``: one evaluation window instead (``posformer-eval eval.context_parallel=P``): the forward
under ``torch.inference_mode`` and the scores of its tokens, no backward (nothing is saved).

    python scripts/bench_context_parallel.py --length 8192 --parallel 1 2 [--pe rope] [--device cpu] [--eval]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posformer.model import ModelConfig, build_model
from posformer.model.parallel import ContextParallel
from posformer.utils.memory import MemoryMeter


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        kind="decoder",
        vocab_size=256,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        d_ff=4 * args.d_model,
        dropout=0.0,
        pe=args.pe,
        attention_chunk_mb=args.attention_chunk_mb,
    )


def step_peak(
    args: argparse.Namespace, cp: ContextParallel | None, device: torch.device
) -> tuple[float, float]:
    """Peak MiB above the state before one forward + backward of this process's tokens (the second step:
    the first's one-time allocations are not the step's), and the MiB autograd saved for the backward."""
    torch.manual_seed(0)
    model = build_model(_config(args)).to(device).train()
    ids = torch.randint(4, 256, (1, args.length), generator=torch.Generator().manual_seed(1)).to(device)
    if cp is not None:
        ids = cp.split(ids)

    def step() -> None:
        with torch.inference_mode(args.eval):
            logits = model(ids, parallel=cp) if cp is not None else model(ids)  # (1, T/P, V)
            loss = logits.float().logsumexp(-1).mean()
        if not args.eval:
            loss.backward()
            model.zero_grad(set_to_none=True)

    step()  # once before measuring: one-time buffers (the communication's, the allocator's) stay out
    saved: dict[int, int] = {}  # storage -> bytes of every tensor autograd keeps for the backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        MemoryMeter(device, settle=True) as meter,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        step()
    return meter.delta_mb, sum(saved.values()) / 2**20


def _worker(rank: int, world: int, rendezvous: str, args: argparse.Namespace, out: list) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    try:
        peaks: list = [None] * world
        dist.all_gather_object(peaks, step_peak(args, ContextParallel.of(), device))
        if rank == 0:
            each = ", ".join(f"{p:.1f}" for p, _ in peaks)
            peak, saved = max(p for p, _ in peaks), max(s for _, s in peaks)
            print(f"P={world}: peak {peak:.1f} MiB per process (ranks: {each}), saved {saved:.1f} MiB")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pe", default="rope")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--attention-chunk-mb", type=int, default=256, help="model.attention_chunk_mb: each process's budget"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--eval", action="store_true", help="one evaluation window: forward only, no grad")
    args = parser.parse_args()
    for world in args.parallel:
        if world == 1:
            device = torch.device("cuda" if args.device == "cuda" else "cpu")
            peak, saved = step_peak(args, None, device)
            print(f"P=1: peak {peak:.1f} MiB, saved {saved:.1f} MiB (unsplit, T={args.length}, pe={args.pe})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _worker, args=(world, f"{tmp}/rendezvous", args, []), nprocs=world, start_method="spawn"
            )


if __name__ == "__main__":
    main()

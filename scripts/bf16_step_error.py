"""One training step under bf16 autocast against the same step in float32, per PE.

    python scripts/bf16_step_error.py                          # cope, dpb, fire, kerple, alibi
    python scripts/bf16_step_error.py --pes cope,dpb --seq-len 1024 --device cuda

A decoder (d_model 64, 2 layers, 4 heads, vocabulary 13) on a random batch, per seed (its weights and
batch); prints the relative error (Frobenius) of the logits and of the gradients of the PE's own
parameters, the mean over ``--seeds`` (one seed's error moves with how the roundings happen to cancel).
It measures how far a half-precision run of each PE is from float32 (docs/performance.md, "The PEs'
position arithmetic in float32 under bf16"):
run it at two revisions (``git worktree``) to see what a change of precision handling did.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from posformer.model import ModelConfig, build_model
from posformer.pe import ENCODINGS


def step(
    pe: str, args: argparse.Namespace, seed: int, autocast: bool
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(loss, logits (B, T, V) float64, the PE's parameter gradients flattened float64) of one step."""
    torch.manual_seed(seed)
    encoder = not ENCODINGS[pe].causal_only
    cfg = ModelConfig(
        vocab_size=13,
        d_model=64,
        n_heads=4,
        n_layers=2,
        d_ff=128,
        dropout=0.0,
        pe=pe,
        pe_apply={"encoder": encoder, "decoder": True, "cross": False},
    )
    model = build_model(cfg).to(args.device).train()
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randint(3, 13, (2, args.seq_len), generator=g).to(args.device)  # (B, T)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)  # (B, T, V)
    loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    grads = [
        p.grad.flatten() for n, p in model.named_parameters() if n.startswith("pe") and p.grad is not None
    ]
    pe_grads = torch.cat(grads).double() if grads else torch.zeros(1, dtype=torch.float64)
    return loss.item(), logits.detach().double(), pe_grads


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm()) if ref.norm() > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pes", default="cope,dpb,fire,kerple,alibi", help="comma-separated PE names")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per row (default 512: past 256)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds averaged (default 5)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| PE | logits rel. error (mean of {args.seeds}) | PE-parameter gradients rel. error |")
    print("|---|---:|---:|")
    for pe in args.pes.split(","):
        errors = []
        for seed in range(args.seeds):
            _, logits0, grads0 = step(pe, args, seed, autocast=False)
            _, logits1, grads1 = step(pe, args, seed, autocast=True)
            errors.append((relative(logits1, logits0), relative(grads1, grads0)))
        logit_err, grad_err = (sum(col) / len(col) for col in zip(*errors))
        print(f"| {pe} | {logit_err:.2e} | {grad_err:.2e} |")


if __name__ == "__main__":
    main()

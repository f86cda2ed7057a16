"""Quality parity with x-transformers at an equal budget.

Trains the same char-level LM recipe with posformer and with x-transformers (the ``[bench]`` extra)
on one text and compares the non-overlapping validation loss (nats/char) at 1x and 16x the training
length. Both sides share everything outside the model: vocabulary, 90/10 split, the random crops
of every step (same seed -> same batches), AdamW + weight-decay exclusions, warm-up + cosine
schedule (``posformer.lit.optim.build_schedule`` on both), gradient clipping and the evaluation.

The ``--p-*`` options change the posformer side only, so each suspected difference can be measured:

    python scripts/parity_xt.py --seeds 0 1 2                     # the defaults against x-t, 3 seeds
    python scripts/parity_xt.py --libs posformer --pes t5 --p-t5-scale 1 --p-t5-init-std 0.02 --tag t5_old
    python scripts/parity_xt.py --libs posformer --p-init xavier --p-scale-emb --tag old_body  # before

Runs are appended to ``<out>/runs.jsonl`` and skipped when already there (same library, PE, seed,
variant and recipe), so a study can be extended run by run; ``results_<tag>.json`` and
``results_<tag>.md`` hold the table over the stored runs of the chosen variant.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import posformer
from posformer.lit.optim import build_schedule, parameter_groups
from posformer.model import ModelConfig, build_model
from posformer.pe import get_encoding_class

PES = ("rope", "alibi", "t5", "learned", "sinusoidal", "nope")
SCORED_CHARS = 32768


# ----------------------------------------------------------------------------------- data
def load_text(path: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Char vocabulary over the whole text; the first 90% trains, the last 10% validates."""
    text = Path(path).read_text(encoding="utf-8")
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:], len(stoi)


def crop_starts(n_train: int, seq_len: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """(steps, batch) random crop offsets: the same for both libraries at a given seed."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, n_train - seq_len - 1, (steps, batch), generator=g)


def crops(data: torch.Tensor, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts.view(-1, 1) + torch.arange(length + 1)
    chunk = data[idx]  # (B, length + 1)
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def val_loss(forward, val: torch.Tensor, length: int, batch_chars: int = 16384) -> float:
    """Mean loss over non-overlapping windows of ``length`` covering ``SCORED_CHARS`` scored chars."""
    n_win = math.ceil(SCORED_CHARS / length)
    if n_win * length + 1 > len(val):
        raise SystemExit(f"validation text too short for {n_win} windows of {length}")
    starts = torch.arange(n_win) * length
    per_batch = max(1, batch_chars // length)
    total, count = 0.0, 0
    for i in range(0, n_win, per_batch):
        x, y = crops(val, starts[i : i + per_batch], length)
        logits = forward(x)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


# ----------------------------------------------------------------------------------- models
def p_options(args, pe: str, long_len: int) -> dict:
    opts: dict = {"max_len": long_len} if pe == "learned" else {}
    if pe == "t5":
        opts.update(num_buckets=args.t5_buckets, max_distance=args.t5_max_distance)
        if args.p_t5_scale is not None:
            opts["scale"] = args.p_t5_scale if args.p_t5_scale == "auto" else float(args.p_t5_scale)
        if args.p_t5_init_std is not None:
            opts["init_std"] = args.p_t5_init_std
    for item in args.p_opt:  # pe=key=value, value parsed as JSON when possible
        name, key, value = item.split("=", 2)
        if name == pe:
            try:
                opts[key] = json.loads(value)
            except json.JSONDecodeError:
                opts[key] = value
    return opts


def p_config(args, pe: str, vocab: int, long_len: int) -> ModelConfig:
    """posformer's decoder config; a ``--p-*`` toggle left unset keeps ``ModelConfig``'s default."""
    toggles = {
        "init": args.p_init,
        "scale_embedding": args.p_scale_emb,
        "tie_embeddings": args.p_tie,
        "bias": args.p_bias,
    }
    return ModelConfig(
        kind="decoder",
        vocab_size=vocab,
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        d_ff=args.d_ff,
        dropout=0.0,
        attn_dropout=0.0,
        activation="gelu",
        pe=pe,
        pe_options=p_options(args, pe, long_len),
        **{k: v for k, v in toggles.items() if v is not None},
    )


def resolved_variant(args, pe: str) -> dict:
    """What the posformer side runs ``pe`` with, defaults resolved (an explicit default = unset)."""
    cfg = p_config(args, pe, 256, args.seq_len * args.long_factor)
    params = inspect.signature(get_encoding_class(pe).__init__).parameters.values()
    options = {
        p.name: p.default
        for p in params
        if p.kind is p.KEYWORD_ONLY and p.name not in ("d_model", "n_heads", "causal", "n_layers")
    }
    options.update(cfg.pe_options)
    model = {k: getattr(cfg, k) for k in ("init", "scale_embedding", "tie_embeddings", "bias")}
    if "embed" in get_encoding_class(pe).capabilities.hooks:  # added in units of the embedding std
        model["embed_units"] = cfg.embedding_std
    rest = {k: getattr(args, k) for k in ("p_emb_std", "p_pe_lr_mult", "p_decay_pe")}
    return {**model, "pe_options": options, **rest}


def build_posformer(args, pe: str, vocab: int, long_len: int) -> tuple[nn.Module, list[nn.Module]]:
    cfg = p_config(args, pe, vocab, long_len)
    model = build_model(cfg)
    pe_mods = [m for m in model.modules() if isinstance(m, get_encoding_class(pe))]
    if args.p_emb_std is not None:  # re-initialise the token embedding N(0, std)
        nn.init.normal_(model.tok_emb.weight, std=args.p_emb_std)
    return model, pe_mods


def build_xt(args, pe: str, vocab: int, long_len: int) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    dh = args.d_model // args.n_heads
    layer_kw: dict = dict(
        dim=args.d_model,
        depth=args.n_layers,
        heads=args.n_heads,
        attn_dim_head=dh,
        ff_mult=args.d_ff // args.d_model,
        pre_norm=True,
        attn_flash=pe != "t5",  # flash = SDPA, exact
    )
    wrap_kw: dict = dict(  # alibi would otherwise keep x-t's learned absolute embedding too
        use_abs_pos_emb=pe in ("learned", "sinusoidal"), scaled_sinu_pos_emb=pe == "sinusoidal"
    )
    if pe == "rope":
        layer_kw.update(rotary_pos_emb=True, rotary_emb_dim=dh)  # full rotary, as posformer's default
    elif pe == "alibi":
        layer_kw.update(alibi_pos_bias=True)
    elif pe == "t5":
        layer_kw.update(
            rel_pos_bias=True, rel_pos_num_buckets=args.t5_buckets, rel_pos_max_distance=args.t5_max_distance
        )
    return TransformerWrapper(
        num_tokens=vocab,
        max_seq_len=long_len,
        attn_layers=Decoder(verbose=False, **layer_kw),
        tie_embedding=args.xt_tie,
        **wrap_kw,
    )


def xt_groups(model: nn.Module, wd: float, decay_pe: bool) -> list[dict]:
    """posformer's default exclusions by name: no decay for biases, norm gains and PE parameters."""
    import x_transformers.x_transformers as xt

    pe_types = (xt.RelativePositionBias, xt.AbsolutePositionalEmbedding, xt.ScaledSinusoidalEmbedding)
    keep: set[int] = set()
    for m in model.modules():
        if isinstance(m, xt.LayerNorm | nn.LayerNorm) or (isinstance(m, pe_types) and not decay_pe):
            keep.update(id(p) for p in m.parameters())
    keep.update(id(p) for n, p in model.named_parameters() if n.endswith("bias"))
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in keep], "weight_decay": wd},
        {"params": [p for p in params if id(p) in keep], "weight_decay": 0.0},
    ]


def p_groups(model: nn.Module, pe_mods: list[nn.Module], args) -> list[dict]:
    groups = parameter_groups(model, args.wd, {"pe": not args.p_decay_pe})
    pe_ids = {id(p) for m in pe_mods for p in m.parameters()}
    if args.p_pe_lr_mult == 1.0 or not pe_ids:
        return groups
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in pe_ids]
        mine = [p for p in g["params"] if id(p) in pe_ids]
        out += [{**g, "params": rest}] if rest else []
        out += [{**g, "params": mine, "lr": args.lr * args.p_pe_lr_mult}] if mine else []
    return out


@torch.no_grad()
def t5_far_bias(model: nn.Module) -> list[float]:
    """Effective T5 bias of the last bucket (offsets >= max_distance) per head, as added to the scores."""
    for m in model.modules():
        if hasattr(m, "relative_attention_bias"):  # x-t RelativePositionBias
            w = m.relative_attention_bias.weight * m.scale
            break
        if hasattr(m, "num_buckets") and hasattr(m, "table"):  # posformer T5Bias
            w = m.table.weight * m.scale
            break
    return [round(float(v), 2) for v in w[-1]]


# ----------------------------------------------------------------------------------- one run
def run_one(args, lib: str, pe: str, seed: int, data) -> dict:
    train, val, vocab = data
    long_len = args.long_factor * args.seq_len
    torch.manual_seed(seed)
    if lib == "posformer":
        model, pe_mods = build_posformer(args, pe, vocab, long_len)
        groups = p_groups(model, pe_mods, args)
    else:
        model = build_xt(args, pe, vocab, long_len)
        groups = xt_groups(model, args.wd, decay_pe=False)  # posformer's default exclusions
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = build_schedule(
        opt,
        {"name": "cosine", "warmup_steps": args.warmup, "min_lr_ratio": 0.0},
        d_model=args.d_model,
        max_steps=args.steps,
    )
    starts = crop_starts(len(train), args.seq_len, args.steps, args.batch, seed)
    model.train()
    t0, ema = time.perf_counter(), None
    for step in range(args.steps):
        x, y = crops(train, starts[step], args.seq_len)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if args.log_every and (step + 1) % args.log_every == 0:
            took = time.perf_counter() - t0
            print(f"  [{lib} {pe} s{seed}] step {step + 1} loss {ema:.3f} ({took:.0f}s)", flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    res = {
        "lib": lib,
        "pe": pe,
        "seed": seed,
        "train_loss_ema": ema,
        "train_s": round(train_s, 1),
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
    }
    for factor in (1, args.long_factor):
        res[f"val_{factor}x"] = val_loss(model, val, factor * args.seq_len)
    res["eval_s"] = round(time.perf_counter() - t0 - train_s, 1)
    if pe == "t5":
        res["t5_far_bias"] = t5_far_bias(model)
    return res


# ----------------------------------------------------------------------------------- report
RECIPE_KEYS = (
    "d_model",
    "n_heads",
    "n_layers",
    "d_ff",
    "seq_len",
    "batch",
    "steps",
    "lr",
    "warmup",
    "wd",
    "clip",
    "long_factor",
    "t5_buckets",
    "t5_max_distance",
    "data",
)
VARIANT_KEYS = (
    "p_init",
    "p_emb_std",
    "p_scale_emb",
    "p_tie",
    "p_bias",
    "p_t5_scale",
    "p_t5_init_std",
    "p_pe_lr_mult",
    "p_decay_pe",
    "p_opt",
)


def key_of(args, lib: str, pe: str) -> str:
    recipe = {k: getattr(args, k) for k in RECIPE_KEYS}
    variant = resolved_variant(args, pe) if lib == "posformer" else {"tie": args.xt_tie}
    return hashlib.sha1(json.dumps([recipe, variant], sort_keys=True, default=str).encode()).hexdigest()[:10]


def what_differs(args) -> list[str]:
    """Remaining differences between the two models as built by this script's current options."""
    cfg = p_config(args, "t5", 256, args.seq_len)
    t5 = posformer.build_encoding(
        "t5", d_model=args.d_model, n_heads=args.n_heads, causal=True, **cfg.pe_options
    )
    out = []
    if cfg.init == "xavier":
        out.append("init: posformer xavier-uniform on all Linear (fused QKV, out, FFN); x-t PyTorch defaults")
    if args.p_emb_std is not None:
        out.append(
            f"token embedding init: posformer N(0, {args.p_emb_std}); x-t kaiming normal (std sqrt(2/d))"
        )
    elif cfg.init == "xavier":
        out.append(
            "token embedding init: posformer N(0, d^-1/2) when scaled, else N(0, 0.02); "
            "x-t kaiming normal (std sqrt(2/d))"
        )
    if cfg.scale_embedding:
        out.append("posformer multiplies token embeddings by sqrt(d_model); x-t does not")
    if cfg.bias:
        out.append(
            "posformer attention projections have biases; x-t attention is bias-free (both FFNs have biases)"
        )
    out.append("LayerNorm: posformer nn.LayerNorm (gain + bias); x-t gain only (unit offset), no bias")
    if args.xt_tie and cfg.tie_embeddings:
        out.append("tied output: x-t multiplies logits by d^-1/2 (tie_embedding_scale); posformer does not")
    elif args.xt_tie != cfg.tie_embeddings:
        out.append(f"tying differs: posformer tie={cfg.tie_embeddings}, x-t tie={args.xt_tie}")
    dh = args.d_model // args.n_heads
    if abs(t5.scale - dh**0.5) > 1e-9:
        out.append(f"t5: x-t bias x sqrt(Dh) = {dh**0.5:.3f}; posformer x {t5.scale:g}")
    init_std = resolved_variant(args, "t5")["pe_options"]["init_std"]
    if init_std != 1.0:
        out.append(f"t5 table init: x-t N(0, 1); posformer N(0, {init_std}^2) (option init_std)")
    units = f"x the embedding std {cfg.embedding_std:.3g}" if cfg.embedding_std != 1.0 else "unscaled"
    learned_std = resolved_variant(args, "learned")["pe_options"]["init_std"]
    out.append(f"learned: posformer table N(0, {learned_std}^2) {units}; x-t N(0, 1) x d^-1/2")
    out.append(
        f"sinusoidal: posformer fixed interleaved table {units}; "
        "x-t concatenated sin|cos, learnable scale from d^-1/2"
    )
    out.append("rope: posformer half layout, x-t interleaved pairs (equivalent up to a fixed permutation)")
    return out


def summarise(rows: list[dict], args) -> str:
    lines = [
        f"# posformer vs x-transformers ({args.data}, {args.steps} steps x {args.batch} x {args.seq_len}, "
        f"d{args.d_model}/{args.n_layers}L/{args.n_heads}H, lr {args.lr}, wd {args.wd})",
        "",
        f"Validation loss, nats/char, {SCORED_CHARS} chars, mean ± std over seeds (n).",
        "",
        f"| PE | posformer 1× | x-t 1× | gap 1× | posformer {args.long_factor}× | x-t {args.long_factor}× "
        f"| gap {args.long_factor}× |",
        "|---|---|---|---|---|---|---|",
    ]

    def stat(pe, lib, col):
        v = [r[col] for r in rows if r["pe"] == pe and r["lib"] == lib]
        if not v:
            return None, "—"
        m, s = statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0
        return m, f"{m:.3f} ± {s:.3f} ({len(v)})"

    for pe in args.pes:
        cells = []
        for col in ("val_1x", f"val_{args.long_factor}x"):
            (pm, ps), (xm, xs) = stat(pe, "posformer", col), stat(pe, "xt", col)
            gap = f"{pm - xm:+.3f}" if pm is not None and xm is not None else "—"
            cells += [ps, xs, gap]
        lines.append(f"| {pe} | " + " | ".join(cells) + " |")
    variant = ", ".join(f"{k}={getattr(args, k)}" for k in VARIANT_KEYS)
    lines += ["", f"posformer variant `{args.tag}`: {variant}", "", "## What still differs", ""]
    lines += [f"- {d}" for d in what_differs(args)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/tinyshakespeare/input.txt")
    ap.add_argument("--out", default="outputs/parity_xt")
    ap.add_argument("--libs", nargs="+", default=["posformer", "xt"], choices=["posformer", "xt"])
    ap.add_argument("--pes", nargs="+", default=list(PES), choices=PES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tag", default="default", help="name of the posformer variant (for the table)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--long-factor", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--t5-buckets", type=int, default=32, help="both sides (x-t rel_pos_num_buckets)")
    ap.add_argument("--t5-max-distance", type=int, default=128, help="both sides (x-t rel_pos_max_distance)")
    ap.add_argument(
        "--xt-tie",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="x-t tie_embedding (its default: untied; posformer ties by default)",
    )
    g = ap.add_argument_group("posformer-side toggles (one suspected difference each)")
    g.add_argument(
        "--p-init",
        choices=["xavier", "torch"],
        default=None,
        help="ModelConfig.init (default: the decoder's, torch)",
    )
    g.add_argument(
        "--p-emb-std", type=float, default=None, help="re-initialise the token embedding N(0, std)"
    )
    bool_opt = argparse.BooleanOptionalAction
    g.add_argument("--p-scale-emb", action=bool_opt, default=None, help="ModelConfig.scale_embedding")
    g.add_argument("--p-tie", action=bool_opt, default=None, help="ModelConfig.tie_embeddings")
    g.add_argument("--p-bias", action=bool_opt, default=None, help="ModelConfig.bias (attention and FFN)")
    g.add_argument(
        "--p-t5-scale",
        default=None,
        help="t5 option scale: bias multiplier ('auto': sqrt(Dh), as x-t; default: the PE's)",
    )
    g.add_argument(
        "--p-t5-init-std",
        type=float,
        default=None,
        help="t5 option init_std: table init N(0, std) (default: the PE's)",
    )
    g.add_argument("--p-pe-lr-mult", type=float, default=1.0, help="lr multiplier of the PE parameters")
    g.add_argument("--p-decay-pe", action="store_true", help="weight-decay PE parameters (no_decay.pe=False)")
    g.add_argument("--p-opt", nargs="*", default=[], help="extra PE options, e.g. t5=num_buckets=64")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "runs.jsonl"
    done = [json.loads(line) for line in store.read_text().splitlines()] if store.exists() else []
    data = load_text(args.data)
    for seed in args.seeds:
        for pe in args.pes:
            for lib in args.libs:
                key = key_of(args, lib, pe)
                if any(r["key"] == key and r["pe"] == pe and r["seed"] == seed for r in done):
                    continue
                res = run_one(args, lib, pe, seed, data)
                res.update(key=key, tag=args.tag if lib == "posformer" else "xt")
                print(json.dumps(res), flush=True)
                done.append(res)
                with store.open("a") as f:
                    f.write(json.dumps(res) + "\n")
    keys = {(lib, pe): key_of(args, lib, pe) for lib in ("posformer", "xt") for pe in args.pes}
    rows = [r for r in done if r["seed"] in args.seeds and r["key"] == keys.get((r["lib"], r["pe"]))]
    md = summarise(rows, args)
    print(md)
    stem = f"results_{args.tag}"
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "runs": rows, "what_differs": what_differs(args)}, indent=2)
    )


if __name__ == "__main__":
    main()

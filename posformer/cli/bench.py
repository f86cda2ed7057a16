"""``posformer-bench``: the side-by-side speed benchmark (:mod:`posformer.bench`) from the command line.

    posformer-bench --quick --out /tmp/b              # smoke test, tiny model
    posformer-bench --pes rope,alibi,t5 --sections train --reps 5 --d-model 512
    posformer-bench --pes alibi,t5 --sections train --before denormals   # before/after, one run
    python scripts/bench.py ...                       # the same

Errors a user can cause (an unknown PE is an argparse usage error, status 2; a bad option value or
running out of memory) are one ``posformer-bench: error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import posformer.bench
from posformer.bench.config import (
    BASELINE_PE,
    CUDA_STEPS_PER_REP,
    FLEX_DIVISIBLE,
    FLEX_OFFSETS,
    KEEP_DENORMALS,
    POLICY_SWITCHES,
    BenchConfig,
    apply_quick,
)
from posformer.cli.boundary import error_boundary
from posformer.model.backends import BACKENDS, CATCH_ALL
from posformer.pe import list_encodings

#: BenchConfig fields exposed as integer command-line flags (--d-model, --seq-len, ...)
_INT_FLAGS = (
    "vocab",
    "d_model",
    "n_layers",
    "n_heads",
    "seq_len",
    "batch",
    "documents",
    "reps",
    "steps_per_rep",
    "warmup",
    "eval_d_model",
    "eval_reps",
    "gen_prompt",
    "gen_tokens",
    "threads",
    "chunk_mb",
)


#: the help of every integer flag (argparse shows each default)
_INT_HELP = {
    "vocab": "vocabulary size of the benchmark models",
    "d_model": "train/gen: model width",
    "n_layers": "layers of every model",
    "n_heads": "attention heads",
    "seq_len": "train: tokens per sequence",
    "batch": "train: sequences per step",
    "documents": "train: documents packed into each sequence, equal lengths (posformer's segment ids; "
    "x-transformers is not compared above 1)",
    "reps": "train, mfu: timed repetitions per PE (the median is reported)",
    "steps_per_rep": "train, mfu: steps timed together in a repetition, one device sync at each end "
    f"(0: {CUDA_STEPS_PER_REP} on CUDA, where a lone step would start with an empty queue; 1 on the CPU)",
    "warmup": "train, mfu: untimed steps before timing",
    "eval_d_model": "eval: model width of the long-context forward",
    "eval_reps": "eval/gen: timed repetitions",
    "gen_prompt": "gen: prompt tokens",
    "gen_tokens": "gen: generated tokens",
    "threads": "CPU threads (0: torch's default)",
    "chunk_mb": "model.attention_chunk_mb of posformer's models",
}


def _comma_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``posformer-bench``, each with its help and (``ArgumentDefaultsHelpFormatter``) its
    default from :class:`BenchConfig`."""
    description = (posformer.bench.__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(
        prog="posformer-bench",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = BenchConfig()
    p.add_argument("--pes", default=",".join(d.pes), help=f"comma list (all: {','.join(list_encodings())})")
    for key in _INT_FLAGS:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=getattr(d, key), help=_INT_HELP[key])
    p.add_argument(
        "--eval-lengths", default=",".join(map(str, d.eval_lengths)), help="eval: tokens per forward"
    )
    p.add_argument("--eval-pes", default="", help="comma list of PEs to evaluate (default: all of --pes)")
    p.add_argument("--mfu-d-models", default=",".join(map(str, d.mfu_d_models)), help="mfu: model widths")
    p.add_argument("--mfu-pes", default=",".join(d.mfu_pes), help="mfu: PEs measured at each width")
    p.add_argument("--sections", default=",".join(d.sections), help="any of train,mfu,eval,gen")
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip x-transformers")
    p.add_argument("--compile", action="store_true", help="torch.compile the models (posformer and x-t)")
    p.add_argument(
        f"--no-{BASELINE_PE}-reference",
        dest="nope_reference",
        action="store_false",
        help=f"do not alternate each PE with posformer's {BASELINE_PE} "
        f"(vs-{BASELINE_PE} ratio from separate runs)",
    )
    p.add_argument("--foreach-adam", dest="fused_adam", action="store_false", help="AdamW(foreach) not fused")
    p.add_argument("--device", default=d.device, help="auto|cpu|cuda")
    p.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU)|fp32|bf16")
    p.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=("auto", "flex", "sdpa"),
        help="posformer's attention: auto (FlexAttention on CUDA), flex or sdpa (model.attention_backend)",
    )
    p.add_argument(
        "--before",
        default="",
        help="comma list of changes to undo in an extra training run alternated with each PE's (the 'vs "
        f"before' column): {KEEP_DENORMALS} (keep denormal floats), {FLEX_OFFSETS} (FlexAttention "
        "computes an offset-only bias per score instead of reading the offset vector), "
        f"{FLEX_DIVISIBLE} (CUDA's FlexAttention kernel checks every tile's bounds at lengths that are "
        "multiples of 128) and/or attention backend names (switched off), e.g. --before denormals,offset",
    )
    p.add_argument(
        "--keep-denormals",
        dest="flush_denormal",
        action="store_false",
        help="do not flush float32 denormals to 0 (both libraries; posformer.cpu.configure_cpu)",
    )
    p.add_argument("--out", default=d.out, help="folder for bench.json and bench.md")
    p.add_argument("--quick", action="store_true", help="tiny smoke-test configuration")
    return p


def given_options(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options ``argv`` gives explicitly (whatever their values: ``--d-model 32``
    too), parsed again with every default suppressed."""
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """The command line -> a checked :class:`BenchConfig` (``--quick`` applied); a bad PE or ``--before``
    name is argparse's one-line error."""
    p = build_parser()
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in _comma_list(s)]  # noqa: E731
    cfg = BenchConfig(
        pes=_comma_list(a.pes),
        eval_lengths=ints(a.eval_lengths),
        mfu_d_models=ints(a.mfu_d_models),
        mfu_pes=_comma_list(a.mfu_pes),
        sections=_comma_list(a.sections),
        nope_reference=a.nope_reference,
        eval_pes=_comma_list(a.eval_pes),
        fused_adam=a.fused_adam,
        compare=a.compare,
        compile=a.compile,
        device=a.device,
        dtype=a.dtype,
        attention_backend=a.attention_backend,
        before=_comma_list(a.before),
        flush_denormal=a.flush_denormal,
        out=a.out,
        **{k: getattr(a, k) for k in _INT_FLAGS},
    )
    if a.quick:  # the preset's sizes, except the ones given explicitly
        apply_quick(cfg, keep=given_options(build_parser(), argv))
    for flag, names in (("--pes", cfg.pes), ("--mfu-pes", cfg.mfu_pes)):
        unknown = set(names) - set(list_encodings())
        if unknown:
            p.error(f"{flag}: unknown PE(s) {sorted(unknown)}; valid: {', '.join(list_encodings())}")
    valid = [KEEP_DENORMALS, *POLICY_SWITCHES, *sorted(set(BACKENDS) - CATCH_ALL)]
    bad = [name for name in cfg.before if name not in valid]
    if bad:
        p.error(f"--before {','.join(bad)}: not a change the benchmark can undo; valid: {', '.join(valid)}")
    if cfg.steps_per_rep < 0:
        p.error(f"--steps-per-rep {cfg.steps_per_rep}: must be at least 1 (or 0: auto)")
    if not 1 <= cfg.documents <= cfg.seq_len:
        p.error(f"--documents {cfg.documents}: must be between 1 and --seq-len ({cfg.seq_len})")
    return cfg


@error_boundary("posformer-bench")
def main(argv: list[str] | None = None) -> None:
    """Console script ``posformer-bench``."""
    from posformer.bench.report import print_table
    from posformer.bench.run import run

    cfg = parse_args(argv)
    results = run(cfg)
    print_table(results)
    print(f"wrote {Path(cfg.out) / 'bench.json'} and {Path(cfg.out) / 'bench.md'}")


if __name__ == "__main__":
    main()

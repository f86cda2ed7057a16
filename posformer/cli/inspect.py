"""``posformer-inspect``: look at what a positional encoding encodes, without training.

Usage (Hydra-style ``key=value`` overrides)::

    posformer-inspect pe=sinusoidal d_model=512 max_len=512
    posformer-inspect pe=rope d_model=256 n_heads=4 pe_options.base=500 offsets=[3,7]
    python -m posformer.cli.inspect pe=alibi n_heads=8 out_dir=/tmp/alibi

Keys: ``pe`` (registry name), ``d_model``, ``n_heads``, ``max_len`` (positions ``0 … max_len-1``),
``causal`` (build the PE for decoder self-attention; default true), ``offsets`` (extra offsets k for
the tables), ``out_dir`` (default ``outputs/inspect/<pe>/``), ``seed`` (initialisation of learned PEs)
and ``pe_options.*`` (merged over ``configs/pe/<pe>.yaml``).

Printed:

* embedding PEs (sinusoidal, learned): the mean cosine similarity of ``PE(p)`` and ``PE(p+k)`` over
  every ``p``, for k = 1, 2, 5, 10, 50, 100, 200 and the requested offsets;
* every PE: the mean position-only attention logit (:meth:`PositionalEncoding.position_logits`) of a
  query at ``i`` and a key at ``i-k`` (and ``i+k`` for bidirectional PEs), head mean and per head;
* sinusoidal and rotary PEs: the wavelength ``2π/θ_i`` (``= 2π·base^(2i/d)`` unscaled) of a few
  dimension pairs, first to last.

Errors (a bad override, a PE that cannot represent ``max_len`` positions) are one
``posformer-inspect: error: ...`` line on stderr and exit status 1. The numbers and figures come from
:mod:`posformer.analysis`.

Written to ``out_dir`` (PNG, printed paths): ``pe_matrix.png`` and ``cosine_similarity.png`` (the
Toeplitz-like position × position cosine-similarity matrix) for embedding PEs;
``position_logits_mean.png`` and ``position_logits_heads.png`` for every PE.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError
from rich.console import Console
from rich.table import Table

from posformer.analysis import cosine_matrix, embedding_matrix, head_grid, heatmap, mean_diagonal, wavelengths
from posformer.cli.boundary import error_boundary
from posformer.errors import ConfigError
from posformer.model.positions import arange_positions
from posformer.pe import DEFAULT_ENCODING, build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding

DEFAULT_OFFSETS = (1, 2, 5, 10, 50, 100, 200)
PE_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "pe"

DEFAULTS: dict[str, Any] = {
    "pe": DEFAULT_ENCODING,
    "d_model": 512,
    "n_heads": 8,
    "max_len": 512,
    "causal": True,
    "offsets": [],
    "out_dir": None,
    "seed": 0,
    "pe_options": {},
}


def _table(title: str, caption: str) -> Table:
    """A rich table wide enough that its title and caption do not wrap."""
    return Table(title=title, caption=caption, min_width=max(len(title), len(caption)) + 4)


# ---------------------------------------------------------------------------- configuration
def parse_overrides(overrides: list[str]) -> DictConfig:
    """``key=value`` overrides over :data:`DEFAULTS` and the PE's ``configs/pe/<pe>.yaml`` options."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(
            f"posformer-inspect: expected key=value overrides, got {bad}; e.g. pe=rope d_model=256."
        )
    user = OmegaConf.from_dotlist(overrides)
    base = OmegaConf.create(DEFAULTS)
    OmegaConf.set_struct(base, True)
    try:
        with_user = OmegaConf.merge(base, {k: v for k, v in user.items() if k != "pe_options"})
    except ConfigKeyError as exc:
        unknown = sorted(set(user) - set(DEFAULTS))
        raise ConfigError(
            f"posformer-inspect: unknown key(s) {unknown}; valid keys: {', '.join(DEFAULTS)}."
        ) from exc
    cfg = OmegaConf.to_container(with_user)
    get_encoding_class(cfg["pe"])  # unknown PE -> error listing the valid names
    options: dict[str, Any] = {}
    yaml_path = PE_CONFIG_DIR / f"{cfg['pe']}.yaml"
    if yaml_path.exists():
        options = OmegaConf.to_container(OmegaConf.load(yaml_path)).get("pe_options") or {}
    options.update(OmegaConf.to_container(user.get("pe_options", OmegaConf.create({}))))
    cfg["pe_options"] = options
    for key in ("d_model", "n_heads", "max_len"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"posformer-inspect: {key}={cfg[key]!r} must be a positive integer.")
    if cfg["max_len"] < 2:
        raise ConfigError(f"posformer-inspect: max_len={cfg['max_len']} must be >= 2 to compare positions.")
    return OmegaConf.create(cfg)


def build_pe(cfg: DictConfig) -> PositionalEncoding:
    torch.manual_seed(int(cfg.seed))
    options = OmegaConf.to_container(cfg.pe_options)
    return build_encoding(
        cfg.pe, d_model=int(cfg.d_model), n_heads=int(cfg.n_heads), causal=bool(cfg.causal), **options
    ).eval()


def offsets_for(cfg: DictConfig) -> list[int]:
    wanted = sorted({*DEFAULT_OFFSETS, *(int(k) for k in cfg.offsets)})
    return [k for k in wanted if 0 < k < int(cfg.max_len)]


# ---------------------------------------------------------------------------- main
def inspect_pe(cfg: DictConfig, console: Console | None = None) -> dict[str, Any]:
    """Print the tables, write the PNGs; returns the numbers and the written paths."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the tables into 80 columns
            console.width = 160
    pe = build_pe(cfg)
    T = int(cfg.max_len)
    pe.check_positions(arange_positions(T))
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path("outputs") / "inspect" / cfg.pe
    out_dir.mkdir(parents=True, exist_ok=True)
    offsets = offsets_for(cfg)
    hooks = ", ".join(sorted(pe.caps.hooks)) or "none"
    console.print(
        f"[bold]pe={cfg.pe}[/bold]  hooks: {hooks}  d_model={pe.d_model} n_heads={pe.n_heads} "
        f"positions 0..{T - 1}  causal={pe.causal}  options={dict(cfg.pe_options)}"
    )
    result: dict[str, Any] = {"pe": cfg.pe, "offsets": offsets, "paths": []}

    if "embed" in pe.caps.hooks:
        P = embedding_matrix(pe, T)  # (T, D)
        cos = cosine_matrix(P)  # (T, T)
        result["cosine"] = {k: mean_diagonal(cos, k) for k in offsets}
        table = _table(title="cos-sim PE(p)·PE(p+k)", caption=f"mean over p = 0 … {T - 1}-k")
        table.add_column("offset k", justify="right")
        table.add_column("mean cos-sim", justify="right")
        for k, v in result["cosine"].items():
            table.add_row(str(k), f"{v:.4f}")
        console.print(table)
        result["paths"].append(
            heatmap(
                P.T,
                out_dir / "pe_matrix.png",
                f"{cfg.pe}: PE values (dimension × position)",
                "position",
                "dimension",
            )
        )
        result["paths"].append(
            heatmap(
                cos,
                out_dir / "cosine_similarity.png",
                f"{cfg.pe}: cos-sim of PE(p), PE(q)",
                "position q",
                "position p",
            )
        )

    wl = wavelengths(pe)
    if wl is not None:
        idx, lengths, n = wl
        what = "rotary pair" if "rotary" in pe.caps.hooks else "sin/cos pair"
        table = _table(title="wavelength 2π/θ_i", caption=f"{what} i of {n}; in positions")
        table.add_column("pair i", justify="right")
        table.add_column("dims", justify="right")
        table.add_column("wavelength", justify="right")
        for i, w in zip(idx, lengths):
            paired = getattr(pe, "layout", "") in ("half", "concatenated")  # pair i is (i, i + n)
            dims = f"{i},{i + n}" if paired else f"{2 * i},{2 * i + 1}"
            table.add_row(str(i), dims, f"{w:,.1f}")
        console.print(table)
        result["wavelengths"] = dict(zip(idx, lengths))

    logits = pe.position_logits(arange_positions(T)).float()  # (H|1, T, T)
    heads = min(logits.shape[0], 8)
    bidirectional = not pe.causal
    table = _table(
        title="position-only logit by offset",
        caption="mean over i of logit(query i, key i-k)" + ("; fwd: key i+k" if bidirectional else ""),
    )
    table.add_column("offset k", justify="right")
    table.add_column("mean", justify="right")
    if bidirectional:
        table.add_column("mean fwd", justify="right")
    if logits.shape[0] > 1:
        for h in range(heads):
            table.add_column(f"h{h}", justify="right")
    result["logits"] = {}
    for k in [0, *offsets]:
        back = mean_diagonal(logits, -k)
        result["logits"][k] = back
        row = [str(k), f"{back:.4f}"]
        if bidirectional:
            row.append(f"{mean_diagonal(logits, k):.4f}")
        if logits.shape[0] > 1:
            row += [f"{mean_diagonal(logits[h], -k):.3f}" for h in range(heads)]
        table.add_row(*row)
    console.print(table)
    result["paths"].append(
        heatmap(
            logits.mean(0),
            out_dir / "position_logits_mean.png",
            f"{cfg.pe}: position-only logits, head mean",
            "key position",
            "query position",
        )
    )
    result["paths"].append(head_grid(logits, out_dir / "position_logits_heads.png", f"{cfg.pe}: per head"))
    for path in result["paths"]:
        console.print(f"wrote {path}")
    return result


@error_boundary("posformer-inspect")
def main(argv: list[str] | None = None) -> int:
    """Console script ``posformer-inspect``: ``key=value`` overrides (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    inspect_pe(parse_overrides(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

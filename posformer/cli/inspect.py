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

Written to ``out_dir`` (PNG, printed paths): ``pe_matrix.png`` and ``cosine_similarity.png`` (the
Toeplitz-like position × position cosine-similarity matrix) for embedding PEs;
``position_logits_mean.png`` and ``position_logits_heads.png`` for every PE.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError
from rich.console import Console
from rich.table import Table
from torch import Tensor

from posformer.errors import ConfigError
from posformer.pe import build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding

DEFAULT_OFFSETS = (1, 2, 5, 10, 50, 100, 200)
PE_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "pe"

DEFAULTS: dict[str, Any] = {
    "pe": "sinusoidal",
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


# ---------------------------------------------------------------------------- measurements
def embedding_matrix(pe: PositionalEncoding, length: int) -> Tensor:
    """The PE rows ``PE(0) … PE(length-1)`` of an embedding PE: (T, D) float32."""
    pos = torch.arange(length).unsqueeze(0)
    with torch.no_grad():
        return pe.embed(torch.zeros(1, length, pe.d_model), pos).squeeze(0).float()


def cosine_matrix(rows: Tensor) -> Tensor:
    """Cosine similarity of every pair of rows: (T, D) -> (T, T)."""
    unit = torch.nn.functional.normalize(rows.double(), dim=-1)
    return (unit @ unit.T).float()


def mean_diagonal(matrix: Tensor, k: int) -> float:
    """Mean of the k-th diagonal (``[..., i, i+k]``; ``k < 0``: below) of the last two dims, heads pooled."""
    return float(matrix.diagonal(offset=k, dim1=-2, dim2=-1).double().mean())


def wavelengths(pe: PositionalEncoding) -> tuple[list[int], list[float], int] | None:
    """``(pair indices, wavelengths 2π/θ_i, number of pairs)`` of sinusoidal/rotary PEs, else ``None``."""
    if "rotary" in pe.caps.hooks and hasattr(pe, "frequencies"):
        inv_freq, _, _ = pe.frequencies(1)
    elif "embed" in pe.caps.hooks and hasattr(pe, "base"):
        inv_freq = pe.base ** (-torch.arange(0, pe.d_model, 2, dtype=torch.float64) / pe.d_model)
    else:
        return None
    n = inv_freq.numel()
    idx = sorted({round(x) for x in torch.linspace(0, n - 1, min(n, 8)).tolist()})
    return idx, [float(2 * math.pi / inv_freq[i]) for i in idx], n


def offsets_for(cfg: DictConfig) -> list[int]:
    wanted = sorted({*DEFAULT_OFFSETS, *(int(k) for k in cfg.offsets)})
    return [k for k in wanted if 0 < k < int(cfg.max_len)]


# ---------------------------------------------------------------------------- plots
def _heatmap(matrix: Tensor, path: Path, title: str, xlabel: str, ylabel: str, cmap: str = "RdBu_r") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = matrix.detach().float().numpy()
    fig, ax = plt.subplots(figsize=(7, 5.5))
    lim = float(abs(data).max()) or 1.0
    im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _head_grid(logits: Tensor, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = min(logits.shape[0], 8)
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    lim = float(logits[:heads].abs().max()) or 1.0  # one colour scale, so heads can be compared
    im = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(logits[h].float().numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def inspect_pe(cfg: DictConfig, console: Console | None = None) -> dict[str, Any]:
    """Print the tables, write the PNGs; returns the numbers and the written paths."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the tables into 80 columns
            console.width = 160
    pe = build_pe(cfg)
    T = int(cfg.max_len)
    pe.check_positions(torch.arange(T).unsqueeze(0))
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
            _heatmap(
                P.T,
                out_dir / "pe_matrix.png",
                f"{cfg.pe}: PE values (dimension × position)",
                "position",
                "dimension",
            )
        )
        result["paths"].append(
            _heatmap(
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

    logits = pe.position_logits(T).float()  # (H|1, T, T)
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
        _heatmap(
            logits.mean(0),
            out_dir / "position_logits_mean.png",
            f"{cfg.pe}: position-only logits, head mean",
            "key position",
            "query position",
        )
    )
    result["paths"].append(_head_grid(logits, out_dir / "position_logits_heads.png", f"{cfg.pe}: per head"))
    for path in result["paths"]:
        console.print(f"wrote {path}")
    return result


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

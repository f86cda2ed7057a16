"""``posformer-inspect``: look at what a positional encoding encodes, without training.

A Hydra app (``configs/inspect.yaml``) with the grammar of ``posformer-train``: the ``pe`` and
``model`` groups, ``model.*`` and ``model.pe_options.*`` overrides, ``hydra.run.dir=...``::

    posformer-inspect pe=sinusoidal model.d_model=512 max_len=512
    posformer-inspect pe=rope model.d_model=256 model.n_heads=4 model.pe_options.base=500 offsets=[3,7]
    posformer-inspect pe=alibi model.n_heads=8 hydra.run.dir=/tmp/alibi
    posformer-inspect pe=custom model.pe=mype:LogDistanceBias   # a PE named by its import path
    posformer-inspect --help                                    # keys, PEs, examples

Top-level keys: ``max_len`` (positions ``0 … max_len-1``), ``causal`` (build the PE for decoder
self-attention; default true), ``offsets`` (extra offsets k for the tables), ``max_heads`` (heads in
the per-head figure), ``seed`` (initialisation of learned PEs). The PE is built from ``model`` exactly
as training builds it (``model.d_model``, ``model.n_heads``, ``model.n_layers``, ``model.pe``,
``model.pe_options``), at its initial weights.

A trained PE: ``ckpt=<file.ckpt>`` or ``run=<run dir>`` (its last checkpoint) draws the PE of a
checkpoint with its trained weights (a T5/FIRE/KERPLE bias as training left it); the checkpoint's model
config replaces ``model``, and every title says ``trained, step N`` (else ``initial weights, seed S``)::

    posformer-inspect run=outputs/train/runs/<time> max_len=256

Printed:

* embedding PEs: the mean cosine similarity of ``PE(p)`` and ``PE(p+k)`` over every ``p``, for
  k = 1, 2, 5, 10, 50, 100, 200 and the requested offsets;
* every PE: the mean position-only attention logit (:func:`~posformer.pe.probe.position_logits`) of a
  query at ``i`` and a key at ``i-k`` (and ``i+k`` for bidirectional PEs), head mean and per head;
* sinusoidal and rotary PEs: the wavelength ``2π/θ_i`` (``= 2π·base^(2i/d)`` unscaled) of a few
  dimension pairs, first to last.

Written to the run dir (default ``outputs/inspect/runs/<date_time>/``, with Hydra's ``.hydra/`` and
``inspect.log``): ``inspect.json`` (the printed numbers); ``pe_matrix.png`` and
``cosine_similarity.png`` (the position × position cosine-similarity matrix) for embedding PEs;
``position_logits_mean.png`` and ``position_logits_heads.png`` (one panel per head, or one full-size
panel when the logits are shared by all heads) for every PE. Keys a causal query never sees are grey.
With ``attention_probe=true`` (``probe_batch``, ``probe_source=random|data``), the attention probe of
the whole model (:mod:`posformer.cli.inspect_probe`): ``attention_probe.{json,md,png,svg}``,
``attention_first_token.csv`` and ``attention_entropy.csv``.

Errors (an unknown key or group option, a bad value, a PE that cannot represent ``max_len``
positions) are one ``posformer-inspect: error: ...`` line on stderr and exit status 1, found by
composing the config before Hydra starts, so nothing is created. The numbers and figures come from
:mod:`posformer.analysis`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from posformer.analysis import (
    causal_masked,
    cosine_matrix,
    embedding_matrix,
    head_grid,
    heatmap,
    mean_diagonal,
    wavelengths,
)
from posformer.cli.boundary import ErrorBoundary, precheck_run_dir
from posformer.cli.help import register_help_resolvers
from posformer.cli.inspect_probe import check_probe_config, inspected_model_config, probe_section
from posformer.configs import register_resolvers
from posformer.configs.composition import composition_error
from posformer.configs.plugins import check_plugins
from posformer.devices import torch_device
from posformer.errors import ConfigError
from posformer.model.config import describe_schedule
from posformer.model.positions import arange_positions
from posformer.pe import build_encoding
from posformer.pe.base import PositionalEncoding
from posformer.pe.probe import position_logits

PROG = "posformer-inspect"
DEFAULT_OFFSETS = (1, 2, 5, 10, 50, 100, 200)
TOP_KEYS = (
    "seed",
    "max_len",
    "causal",
    "offsets",
    "max_heads",
    "device",
    "ckpt",
    "run",
    "attention_probe",
    "probe_batch",
    "probe_source",
)
#: keys of the former ``key=value`` dialect -> the override that replaces them
RENAMED = {
    "d_model": "model.d_model",
    "n_heads": "model.n_heads",
    "pe_options": "model.pe_options",
    "out_dir": "hydra.run.dir",
}
_FLAGS_WITHOUT_WORK = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--version")

register_resolvers()
register_help_resolvers()  # ${posformer_pe_list:} of --help


def _table(title: str, caption: str) -> Table:
    """A rich table wide enough that its title and caption do not wrap."""
    return Table(title=title, caption=caption, min_width=max(len(title), len(caption)) + 4)


# ---------------------------------------------------------------------------- configuration
def _composition_error(exc: Exception, overrides: list[str]) -> ConfigError:
    """Hydra's multi-line composition error as one line naming the override and the fix."""
    text = str(exc)
    given = {o.split("=", 1)[0].lstrip("+~"): o for o in overrides if "=" in o}
    m = re.search(r"Could not (?:override|append to) '([^']+)'", text) or re.search(
        r"Key '([^']+)' is not in struct", text
    )
    if m:
        key = m.group(1)
        head = key.split(".")[0]
        if head in RENAMED or key in RENAMED:
            new = RENAMED.get(key) or key.replace(head, RENAMED[head], 1)
            value = given.get(key, key).split("=", 1)[-1]
            return ConfigError(
                f"{given.get(key, key)}: posformer-inspect takes the training grammar now; use "
                f"{new}={value}" + (" (a folder of your choice)" if new == "hydra.run.dir" else "") + "."
            )
        if key.startswith("model.pe_options."):
            return ConfigError(
                f"{given.get(key, key)}: {key.rsplit('.', 1)[1]!r} is not an option of this PE's config; "
                f"add a new one with +{given.get(key, key).lstrip('+')} (pe=custom starts from none)."
            )
        return ConfigError(
            f"{given.get(key, key)}: unknown key {key!r}; valid keys: {', '.join(TOP_KEYS)}, model.<field> "
            "(e.g. model.d_model, model.n_heads; all: --cfg job), hydra.run.dir."
        )
    m = re.search(r"Could not find '(\w+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        hint = (
            "; a PE by import path is pe=custom model.pe=module:Class"
            if group == "pe" and ":" in option
            else ""
        )
        return ConfigError(
            f"{group}={option} is not a config of group {group!r}; valid: {', '.join(options)}{hint}."
        )
    shared = composition_error(exc, overrides)  # posformer-train's words: a typed value, a + on a set key
    if shared is not None:
        return shared
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return ConfigError(f"bad override ({first}); overrides look like pe=rope model.d_model=256 max_len=64.")


def compose_config(overrides: list[str]) -> DictConfig:
    """``configs/inspect.yaml`` with ``overrides`` (no ``hydra.*``), composed as Hydra will; checked."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    own = [o for o in overrides if not o.lstrip("+~").startswith("hydra.") and not o.startswith("-")]
    fresh = not GlobalHydra.instance().is_initialized()
    try:
        if fresh:
            initialize_config_module("posformer.configs", version_base="1.3")
        cfg = compose(config_name="inspect", overrides=own)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _composition_error(exc, own) from None
    finally:
        if fresh:
            GlobalHydra.instance().clear()
    check_config(cfg)
    return cfg


def check_config(cfg: DictConfig) -> None:
    """Raise one :class:`ConfigError` (value, limit, fix) for a bad value; builds the PE to check it."""
    for key, minimum in (("max_len", 2), ("max_heads", 1)):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}; e.g. {key}=64.")
    offsets = cfg.get("offsets")
    if not OmegaConf.is_list(offsets) or any(
        not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in offsets
    ):
        raise ConfigError(f"offsets={offsets!r} must be a list of integers >= 1; e.g. offsets=[3,7].")
    if not isinstance(cfg.get("causal"), bool):
        raise ConfigError(f"causal={cfg.get('causal')!r} must be true or false.")
    if cfg.get("ckpt") and cfg.get("run"):
        raise ConfigError(
            f"ckpt={cfg.ckpt} and run={cfg.run}: give one of them (run= takes its last checkpoint)."
        )
    check_probe_config(cfg)
    device = torch_device(cfg.get("device", "auto"))
    pe, _ = source_pe(cfg)
    pe.check_positions(arange_positions(int(cfg.max_len), device=device))  # e.g. a short learned table


def source_pe(cfg: DictConfig) -> tuple[PositionalEncoding, dict[str, Any]]:
    """The PE to draw and where its weights come from: a checkpoint's (``ckpt=`` / ``run=``: trained)
    or a new one built from ``cfg.model`` (initial). The dict: ``pe``, ``options``, ``weights``
    (``trained`` | ``initial``), ``checkpoint`` and ``step``, or ``seed``."""
    from posformer.checkpoints import checkpoint_step, load_checkpoint  # lazy: a light start-up

    path = cfg.get("ckpt") or None
    if cfg.get("run"):
        from posformer.runs import find_run_checkpoint

        path = find_run_checkpoint(Path(str(cfg.run)).expanduser(), "last")
    if path is None:
        pe, options = build_pe(cfg)
        return pe, {"pe": str(cfg.model.pe), "options": options, "weights": "initial", "seed": int(cfg.seed)}
    loaded = load_checkpoint(path, map_location="cpu")
    found = [(n, m) for n, m in loaded.model.named_modules() if isinstance(m, PositionalEncoding)]
    if not found:
        raise ConfigError(
            f"checkpoint {str(path)!r} (pe={loaded.pe}) holds no positional-encoding module (model.pe_apply "
            "turned it off everywhere); nothing to draw."
        )
    where, pe = found[0]  # the first place the model applies its PE (decoder-only: its one PE)
    info = {
        "pe": loaded.pe,
        "options": dict(loaded.model_cfg.get("pe_options") or {}),
        "weights": "trained",
        "checkpoint": str(path),
        "step": checkpoint_step(Path(path)),
        "module": where,
    }
    schedule = describe_schedule(loaded.model_cfg)
    if schedule != loaded.pe:  # a per-layer schedule: say so, and which layer's PE the figures draw
        info["schedule"] = schedule
    return pe.eval().to(torch_device(cfg.get("device", "auto"))), info


def schedule_line(info: dict[str, Any]) -> str:
    """The header line of a checkpoint with a per-layer schedule: the schedule, and whose PE is drawn."""
    if "schedule" not in info:
        return ""
    return f"\nschedule: {info['schedule']} (the figures draw the PE module {info['module']!r})"


def weights_label(info: dict[str, Any]) -> str:
    """``trained, step 400`` or ``initial weights, seed 0``: what every figure title says."""
    if info["weights"] == "trained":
        return f"trained, step {info['step']}"
    return f"initial weights, seed {info['seed']}"


def build_pe(cfg: DictConfig) -> tuple[PositionalEncoding, dict[str, Any]]:
    """The PE as training builds it from ``cfg.model`` (validated by :class:`ModelConfig`), in eval mode,
    on ``cfg.device``, and its options."""
    if OmegaConf.is_missing(cfg.model, "pe"):
        raise ConfigError(
            "pe=custom needs the PE's import path: add model.pe=module:Class (docs/adding_a_pe.md)."
        )
    mc = inspected_model_config(cfg)
    torch.manual_seed(int(cfg.seed))
    with torch.device("cpu"):  # initialised on the CPU: the same values on every device, then moved
        pe = build_encoding(
            mc.pe,
            d_model=mc.d_model,
            n_heads=mc.n_heads,
            causal=bool(cfg.causal),
            n_layers=max(mc.n_layers, mc.n_encoder_layers, mc.n_decoder_layers),
            **mc.pe_options,
        )
    return pe.eval().to(torch_device(cfg.get("device", "auto"))), dict(mc.pe_options)


def offsets_for(cfg: DictConfig) -> list[int]:
    wanted = sorted({*DEFAULT_OFFSETS, *(int(k) for k in cfg.offsets)})
    return [k for k in wanted if 0 < k < int(cfg.max_len)]


# ---------------------------------------------------------------------------- the inspection
def _embedding_section(
    pe: PositionalEncoding,
    name: str,
    T: int,
    offsets: list[int],
    out_dir: Path,
    console: Console,
    result: dict[str, Any],
) -> None:
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
            f"{name}: PE values (dimension × position)",
            "position",
            "dimension",
            colorbar="PE value",
        )
    )
    result["paths"].append(
        heatmap(
            cos,
            out_dir / "cosine_similarity.png",
            f"{name}: cosine similarity of PE(p), PE(q)",
            "position q",
            "position p",
            colorbar="cosine similarity",
            square=True,
        )
    )


def _wavelength_section(pe: PositionalEncoding, console: Console, result: dict[str, Any]) -> None:
    wl = wavelengths(pe)
    if wl is None:
        return
    idx, lengths, n = wl
    what = "rotary pair" if "rotary" in pe.caps.hooks else "sin/cos pair"
    table = _table(title="wavelength 2π/θ_i", caption=f"{what} i of {n}; in positions")
    table.add_column("pair i", justify="right")
    table.add_column("dims", justify="right")
    table.add_column("wavelength", justify="right")
    paired = getattr(pe, "layout", "") in ("half", "concatenated")  # pair i is (i, i + n)
    for i, w in zip(idx, lengths):
        table.add_row(str(i), f"{i},{i + n}" if paired else f"{2 * i},{2 * i + 1}", f"{w:,.1f}")
    console.print(table)
    result["wavelengths"] = dict(zip(idx, lengths))


def _logits_section(
    pe: PositionalEncoding,
    cfg: DictConfig,
    name: str,
    offsets: list[int],
    out_dir: Path,
    console: Console,
    result: dict[str, Any],
) -> None:
    T = int(cfg.max_len)
    positions = arange_positions(T, device=torch_device(cfg.get("device", "auto")))  # (1, T)
    logits = position_logits(pe, positions).detach().float().cpu()  # (H|1, T, T), drawn from the CPU
    heads = min(logits.shape[0], int(cfg.max_heads))
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
    shown = causal_masked(logits) if pe.causal else logits  # keys after the query: never attended
    result["paths"].append(
        heatmap(
            shown.mean(0),
            out_dir / "position_logits_mean.png",
            f"{name}: position-only attention logits, head mean",
            "key position",
            "query position",
            colorbar="logit",
            square=True,
        )
    )
    result["paths"].append(
        head_grid(
            shown,
            out_dir / "position_logits_heads.png",
            f"{name}: position-only attention logits",
            max_heads=int(cfg.max_heads),
            colorbar="logit",
        )
    )


def inspect_pe(cfg: DictConfig, out_dir: Path, console: Console | None = None) -> dict[str, Any]:
    """Print the tables, write the figures and ``inspect.json`` into ``out_dir``; returns the numbers
    and the written paths. ``cfg``: a composed ``configs/inspect.yaml``."""
    from posformer.io import atomic_write_json, check_writable_dir

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the tables into 80 columns
            console.width = 160
    check_config(cfg)
    pe, info = source_pe(cfg)
    out_dir = Path(out_dir)
    check_writable_dir(out_dir)
    T, options = int(cfg.max_len), info["options"]
    name = f"{info['pe']} ({weights_label(info)})"  # every title says trained or initial
    offsets = offsets_for(cfg)
    hooks = ", ".join(sorted(pe.caps.hooks)) or "none"
    console.print(
        f"[bold]pe={info['pe']}[/bold]  hooks: {hooks}  d_model={pe.d_model} n_heads={pe.n_heads} "
        f"positions 0..{T - 1}  causal={pe.causal}  options={options}  weights: {weights_label(info)}"
        + (f" ({info['checkpoint']})" if info["weights"] == "trained" else "")
        + schedule_line(info)
    )
    result: dict[str, Any] = {
        **info,
        "hooks": sorted(pe.caps.hooks),
        "offsets": offsets,
        "paths": [],
    }
    if "embed" in pe.caps.hooks:
        _embedding_section(pe, name, T, offsets, out_dir, console, result)
    _wavelength_section(pe, console, result)
    _logits_section(pe, cfg, name, offsets, out_dir, console, result)
    if cfg.get("attention_probe", False):
        probe_section(cfg, out_dir, console, result, name)
    result["paths"].append(out_dir / "inspect.json")
    atomic_write_json(
        out_dir / "inspect.json", {**result, "paths": [str(p) for p in result["paths"]]}, indent=2
    )
    for path in result["paths"]:
        console.print(f"wrote {path}", soft_wrap=True)
    return result


# ---------------------------------------------------------------------------- main
def _hydra_main() -> None:
    import hydra

    @hydra.main(config_path="../configs", config_name="inspect", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        with ErrorBoundary(PROG):
            inspect_pe(cfg, Path(cfg.paths.output_dir))

    _main()


def main(argv: list[str] | None = None) -> int:
    """Console script ``posformer-inspect [overrides]``: check the overrides (one error line, nothing
    created), then run the Hydra app. ``argv``: the arguments (default ``sys.argv[1:]``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a in _FLAGS_WITHOUT_WORK or a.startswith("--cfg") for a in argv):
        with ErrorBoundary(PROG):
            precheck_run_dir(argv)  # Hydra creates the run dir first and would fail with a traceback
            check_plugins(argv)  # e.g. hydra/launcher=submitit_slurm without its package
            if not any(a in ("-m", "--multirun") for a in argv):  # a sweep: each job checks its own
                compose_config(argv)
    saved = sys.argv
    sys.argv = [saved[0] if saved else PROG, *argv]
    try:
        _hydra_main()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

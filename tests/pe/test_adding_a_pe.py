"""docs/adding_a_pe.md, executed: its example PE is written to a module outside the package and used
through the registry API, the models, and the command-line mains (train, sweep, eval, inspect)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posformer
from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model
from posformer.pe import Offsets, get_encoding_class

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_pe.md"
PLUGIN = "mype:LogDistanceBias"
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=32",
    "data.n_train=96",
    "data.n_val=32",
    "data.n_eval_per_length=16",
    "data.batch_size=16",
    "data.train_len=[1,4]",
    "data.eval_lengths=[4,8]",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "schedule.warmup_steps=1",
    "logger=none",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
    "callbacks.pe_heatmap=null",
]


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """A folder outside the package holding the doc's example module as ``mype.py``."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "mype.py").write_text(_code_blocks("python")[0])
    return folder


@pytest.fixture()
def on_path(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    yield plugin_dir
    sys.modules.pop("mype", None)


def _env(plugin_dir: Path, tmp: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "POSFORMER_CACHE": str(tmp / "cache")}


def test_plugin_class_is_checked_and_built(on_path):
    cls = get_encoding_class(PLUGIN)
    assert isinstance(cls.capabilities.bias, Offsets) and cls.capabilities.hooks == {"bias"}
    assert cls.name == PLUGIN  # unregistered: its import path names it
    assert PLUGIN not in posformer.list_encodings()  # plugins do not join the built-in registry
    namespace: dict = {}
    exec(_code_blocks("python")[1], namespace)  # the doc's second snippet runs as written
    assert isinstance(namespace["pe"].caps.bias, Offsets)
    with pytest.raises(ConfigError, match="init_slope=-1"):
        posformer.build_encoding(PLUGIN, d_model=16, n_heads=2, init_slope=-1)
    with pytest.raises(ConfigError, match=r"no option\(s\) base.*pe=custom"):
        posformer.build_encoding(PLUGIN, d_model=16, n_heads=2, base=10000.0)


def test_plugin_bias_in_the_model_matches_its_formula(on_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0, pe=PLUGIN)
    model = build_model(cfg).eval()
    pe = model.pe
    pos = torch.arange(6).unsqueeze(0)
    slope = torch.nn.functional.softplus(pe.slope_raw.detach().double()).view(-1, 1, 1)
    want = -slope * torch.log1p((pos[0, :, None] - pos[0, None, :]).abs().double())
    torch.testing.assert_close(pe.bias(pos, pos).squeeze(0).double(), want, rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 11, (2, 6))
    full = model(ids)
    cache = model.new_cache()  # cached decoding through the offset-vector path equals the full forward
    steps = [model(ids[:, t : t + 1], cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_unimportable_or_wrong_plugin_paths_are_clear():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.pe'"):
        get_encoding_class("no_such_pkg.pe:Thing")
    with pytest.raises(ConfigError, match="is not a subclass of posformer.pe.PositionalEncoding"):
        get_encoding_class("posformer.pe.alibi:alibi_slopes")
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        get_encoding_class("posformer.pe.alibi:Nope")


@pytest.mark.slow
def test_plugin_trains_evaluates_sweeps_and_inspects_from_the_command_line(plugin_dir, tmp_path):
    env = _env(plugin_dir, tmp_path)

    def cli(module: str, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run_dir = tmp_path / "run"
    cli(
        "posformer.cli.train",
        "pe=custom",
        f"model.pe={PLUGIN}",
        "+model.pe_options.init_slope=0.25",
        *TINY,
        f"hydra.run.dir={run_dir}",
    )
    results = json.loads((run_dir / "results.json").read_text())
    assert results["pe"] == PLUGIN
    assert {row["length"] for row in results["results"]} == {4, 8}
    assert "init_slope: 0.25" in (run_dir / "config.yaml").read_text()

    out = tmp_path / "eval"
    cli(
        "posformer.cli.evaluate",
        "eval=extrapolate",
        f"eval.checkpoints=[{run_dir}/checkpoints/last.ckpt]",
        "eval.lengths=[4,8]",
        "eval.progress=false",
        "eval.tensorboard=false",
        f"hydra.run.dir={out}",
        "+trust_checkpoint_code=true",
    )  # a module:Class PE in a checkpoint is imported only when trusted
    rows = json.loads((out / "extrapolation.json").read_text())["results"]
    assert {r["length"] for r in rows} == {4, 8} and all(r["pe"] == PLUGIN for r in rows)

    sweep = tmp_path / "sweep"
    cli(
        "posformer.cli.train",
        "-m",
        "pe=custom",
        f"model.pe={PLUGIN}",
        "seed=0,1",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        "evaluate=false",
    )
    assert len(list(sweep.glob("*/checkpoints/last.ckpt"))) == 2

    cli(
        "posformer.cli.inspect",
        "pe=custom",
        f"model.pe={PLUGIN}",
        "+model.pe_options.init_slope=0.25",
        "model.d_model=16",
        "model.n_heads=2",
        "max_len=16",
        f"hydra.run.dir={tmp_path / 'inspect'}",
    )
    assert list((tmp_path / "inspect").glob("*.png"))

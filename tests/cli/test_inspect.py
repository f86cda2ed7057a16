"""posformer-inspect: a Hydra app with the training grammar; tables, figures, inspect.json, errors."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posformer.analysis import causal_masked
from posformer.cli.inspect import compose_config, inspect_pe, main
from posformer.errors import PosformerError
from posformer.pe import PositionalEncoding, get_encoding_class, list_encodings
from posformer.pe.probe import position_logits

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["model.d_model=32", "model.n_heads=2", "max_len=64"]


def printed_table(text: str) -> dict[int, float]:
    """``offset k -> value`` rows of the first two-column table in ``text``."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s*│\s*(\d+)\s*│\s*(-?[\d.]+)\s*│\s*$", line)
        if m:
            rows.setdefault(int(m.group(1)), float(m.group(2)))
    return rows


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work in ``tmp_path`` with the default output root there (``outputs/``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("POSFORMER_ROOT", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "pe",  # ~0.5 s of figures each: sinusoidal (the embed figures), rope and alibi stay fast, the other
    # PEs are slow (test_device_guard's inspection cases are trimmed the same way)
    [
        p if p in ("sinusoidal", "rope", "alibi") else pytest.param(p, marks=pytest.mark.slow)
        for p in list_encodings()
    ],
)
def test_runs_for_every_pe_and_writes_figures(pe: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inspect_pe(compose_config([f"pe={pe}", *TINY]), tmp_path)
    out = capsys.readouterr().out
    written = {p.name for p in tmp_path.glob("*.png")}
    expected = {"position_logits_mean.png", "position_logits_heads.png"}
    if "embed" in get_encoding_class(pe).capabilities.hooks:
        expected |= {"pe_matrix.png", "cosine_similarity.png"}
    assert written == expected
    for name in written:
        assert str(tmp_path / name) in out.replace("\n", "")
    saved = json.loads((tmp_path / "inspect.json").read_text())
    assert saved["pe"] == pe and set(saved["logits"]) >= {"0", "1", "50"}
    assert "position-only logit by offset" in out


@pytest.mark.parametrize("pe", ["sinusoidal", "alibi"])
def test_per_head_figure_is_readable(pe: str, tmp_path: Path) -> None:
    """Logits shared by all heads (sinusoidal): one full-size panel, not a thumbnail; per-head PEs: a grid."""
    inspect_pe(compose_config([f"pe={pe}", "model.d_model=32", "model.n_heads=4", "max_len=32"]), tmp_path)
    width, height = png_size(tmp_path / "position_logits_heads.png")
    if pe == "sinusoidal":
        assert width >= 600 and height >= 600
    else:  # 4 heads side by side, each panel about as large as the single one is wide / 2
        assert width >= 4 * 300 and height >= 300


def test_causal_logits_are_masked_where_attention_never_looks() -> None:
    logits = torch.arange(9.0).view(1, 3, 3)
    masked = causal_masked(logits)
    assert torch.isnan(masked[0, 0, 1]) and torch.isnan(masked[0, 1, 2])
    torch.testing.assert_close(masked[0].tril(), logits[0].tril())


def test_sinusoidal_cosine_similarity_decays_with_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = compose_config(
        ["pe=sinusoidal", "model.d_model=512", "model.n_heads=8", "max_len=512", "offsets=[3,300]"]
    )
    inspect_pe(cfg, tmp_path)
    out = capsys.readouterr().out
    cos = printed_table(out.split("cos-sim PE(p)·PE(p+k)")[1].split("wavelength")[0])
    assert set(cos) == {1, 2, 3, 5, 10, 50, 100, 200, 300}
    assert cos[1] > cos[200]
    assert 0.95 < cos[1] < 1.0
    assert "wavelength" in out and "60,611.5" in out  # 2π·10000^(510/512), the last pair


def test_rope_wavelengths_follow_the_base(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = compose_config(
        ["pe=rope", "model.d_model=64", "model.n_heads=4", "max_len=32", "model.pe_options.base=100"]
    )
    inspect_pe(cfg, tmp_path)
    out = capsys.readouterr().out
    assert "6.3" in out and f"{2 * 3.14159265 * 100 ** (14 / 16):,.1f}" in out  # pair 7 of 8


def test_overrides_merge_over_the_pe_config() -> None:
    cfg = compose_config(["pe=rope", "model.pe_options.base=500", "offsets=[7]"])
    assert cfg.model.pe == "rope" and cfg.model.pe_options.base == 500
    assert cfg.model.pe_options.layout == "half" and list(cfg.offsets) == [7]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["pe=nosuch"], r"pe=nosuch is not a config of group 'pe'; valid: .*\bcustom\b.*\brope\b"),
        (["pe=mype:Foo"], r"pe=custom model\.pe=module:Class"),
        (["pe=custom"], r"model\.pe=module:Class"),
        (["pe=custom", "model.pe=nosuch"], r"'nosuch'.*valid names"),
        (["dmodel=5"], r"dmodel=5: unknown key 'dmodel'; valid keys: seed, max_len"),
        (["d_model=512"], r"use model\.d_model=512"),
        (["out_dir=/tmp/x"], r"use hydra\.run\.dir=/tmp/x"),
        (["model.pe_options.bse=3"], r"add a new one with \+model\.pe_options\.bse=3"),
        (["max_len=1"], r"max_len=1 must be an integer >= 2"),
        (["offsets=[0]"], r"offsets=\[0\] must be a list of integers >= 1"),
        (["model.d_model=30", "model.n_heads=4"], r"d_model=30 is not divisible by model.n_heads=4"),
        (["pe=learned", "model.pe_options.max_len=16", "max_len=64"], r"raise model\.pe_options\.max_len"),
    ],
)
def test_bad_values_are_one_line_and_nothing_is_created(
    argv: list[str], match: str, in_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(PosformerError, match=match):  # ConfigError, PositionRangeError
        compose_config(argv)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and err.startswith("posformer-inspect: error: ") and "Traceback" not in err
    )
    assert not (in_tmp / "outputs").exists()


def test_hydra_app_writes_into_its_run_dir(in_tmp: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = in_tmp / "my_run"
    assert (
        main(
            [
                "pe=rope",
                "model.pe_options.base=500",
                "model.d_model=16",
                "max_len=8",
                f"hydra.run.dir={run_dir}",
            ]
        )
        == 0
    )
    assert {"position_logits_mean.png", "position_logits_heads.png", "inspect.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert "base: 500" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert json.loads((run_dir / "inspect.json").read_text())["options"]["base"] == 500
    main(["pe=nope", "model.d_model=16", "max_len=8"])  # default: outputs/inspect/runs/<time>/
    assert list((in_tmp / "outputs" / "inspect" / "runs").glob("*/position_logits_heads.png"))


def test_help_names_the_encodings_and_examples(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "what a positional encoding encodes" in out
    assert all(f"{name} (" in " ".join(out.split()) for name in list_encodings())  # wrapped list
    assert "posformer-inspect pe=rope model.d_model=256" in out and "pe=custom model.pe=" in out


@pytest.mark.slow  # a subprocess
def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posformer.cli.inspect",
            "pe=nope",
            "model.d_model=8",
            "model.n_heads=1",
            "max_len=4",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "position_logits_mean.png").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "posformer.cli.inspect", "pe=rope", "model.n_heads=0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "model.n_heads=0" in bad.stderr


# ---------------------------------------------------------------------------- a trained checkpoint
@pytest.fixture(scope="module")
def t5_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5-bias model trained for 8 steps at a high learning rate (its bias moves off the init)."""
    import posformer

    root = tmp_path_factory.mktemp("t5_run")
    model = ["pe=t5", "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]
    data = ["data.n_train=64", "data.n_val=16", "data.n_eval_per_length=8", "data.batch_size=16"]
    data += ["data.train_len=[2,8]", "data.eval_lengths=[8]"]
    training = ["trainer=cpu", "trainer.max_steps=8", "optim.lr=0.05", "schedule.warmup_steps=1"]
    quiet = ["logger=none", "callbacks.pe_heatmap=null", "callbacks.lr_monitor=null"]
    paths = [f"paths.cache_dir={root / 'cache'}"]
    result = posformer.train([*model, *data, *training, *quiet, *paths], run_dir=root / "run")
    return result.run_dir


def test_a_checkpoint_draws_its_trained_pe(
    t5_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from posformer.checkpoints import load_checkpoint

    last = t5_run / "checkpoints" / "last.ckpt"
    trained = inspect_pe(compose_config([f"ckpt={last}", "max_len=16"]), tmp_path / "ckpt")
    assert trained["weights"] == "trained" and trained["pe"] == "t5" and trained["step"] == 8
    assert "trained, step 8" in capsys.readouterr().out
    # the numbers are the checkpoint's PE, not a fresh one with the same options
    pe = next(m for m in load_checkpoint(last).model.modules() if isinstance(m, PositionalEncoding))
    expected = position_logits(pe, torch.arange(16).unsqueeze(0)).detach().float()  # (H, T, T)
    assert trained["logits"][1] == pytest.approx(torch.diagonal(expected, -1, -2, -1).mean().item(), abs=1e-4)
    initial = inspect_pe(
        compose_config(["pe=t5", "model.d_model=16", "model.n_heads=2", "max_len=16"]), tmp_path / "init"
    )
    assert initial["weights"] == "initial" and initial["seed"] == 0
    assert any(abs(trained["logits"][k] - initial["logits"][k]) > 1e-3 for k in initial["logits"])
    # run= takes the run's last checkpoint; the JSON records where the weights came from
    by_run = inspect_pe(compose_config([f"run={t5_run}", "max_len=16"]), tmp_path / "run")
    assert by_run["logits"] == trained["logits"]
    saved = json.loads((tmp_path / "run" / "inspect.json").read_text())
    assert saved["weights"] == "trained" and Path(saved["checkpoint"]).name.startswith("last")


def test_figure_titles_say_trained_or_initial(
    t5_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import posformer.cli.inspect as inspect_cli

    titles: list[str] = []
    real = inspect_cli.heatmap
    monkeypatch.setattr(
        inspect_cli,
        "heatmap",
        lambda m, p, title, *a, **k: titles.append(title) or real(m, p, title, *a, **k),
    )
    inspect_pe(compose_config([f"run={t5_run}", "max_len=8"]), tmp_path / "a")
    inspect_pe(compose_config(["pe=t5", "model.d_model=16", "max_len=8", "seed=3"]), tmp_path / "b")
    assert titles[0].startswith("t5 (trained, step 8)") and titles[1].startswith(
        "t5 (initial weights, seed 3)"
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["ckpt=a.ckpt", "run=b"], "give one of them"),
        (["ckpt=missing.ckpt"], "missing.ckpt"),
        (["run=nowhere"], "no checkpoints/ folder"),
    ],
)
def test_bad_checkpoint_arguments_are_one_line(argv: list[str], match: str, in_tmp: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1 and re.search(match, err), err
    assert not (in_tmp / "outputs").exists()

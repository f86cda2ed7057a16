"""Sweeps: job dirs named from the swept keys only (file- and override-safe), labels ``rope · seed 0``,
the summary (mean ± std over seeds) written and printed when a multirun ends, failed jobs reported
with a non-zero exit; and a real multirun with a failing job."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from posformer.cli.sweep_callback import SweepSummary
from posformer.configs import job_dirname, swept_keys, tensorboard_dir
from posformer.eval.sweep import collect
from posformer.eval.sweep_jobs import run_label, split_seed

ROOT = Path(__file__).resolve().parents[2]


def _multirun_yaml(sweep: Path, task: list[str], params: dict | None = None) -> None:
    sweep.mkdir(parents=True, exist_ok=True)
    cfg = {"hydra": {"overrides": {"task": task}, "sweeper": {"params": params}}}
    OmegaConf.save(OmegaConf.create(cfg), sweep / "multirun.yaml")


def _fake_job(root: Path, num: int, pe: str, seed: int, ems: dict[int, float]) -> Path:
    job = root / job_dirname(num, [f"pe={pe}", f"seed={seed}", "model.d_model=16"], root)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- pe={pe}\n- seed={seed}\n- model.d_model=16\n")
    rows = [
        {
            "length": n,
            "in_distribution": n <= 16,
            "exact_match": em,
            "token_acc": em,
            "loss": 1 - em,
            "ppl": 2.0,
            "n_sequences": 10,
            "n_tokens": 100,
        }
        for n, em in ems.items()
    ]
    (job / "results.json").write_text(
        json.dumps(
            {"pe": pe, "seed": seed, "train_length": 16, "data": {"task_type": "task"}, "results": rows}
        )
    )
    return job


def _parse(override: str):
    [parsed] = OverridesParser.create().parse_overrides([override])
    return parsed.value()


def test_job_dirname_swept_keys_only_and_override_safe(tmp_path):
    sweep = tmp_path / "multiruns" / "2024-01-01_10-00-00"
    _multirun_yaml(sweep, ["pe=rope,alibi", "model.d_model=16", "model.n_heads=2,4", "seed=range(2)"])
    assert swept_keys(sweep) == ("pe", "model.n_heads", "seed")
    job = ["seed=1", "pe=rope", "model.d_model=16", "model.n_heads=2"]
    name = job_dirname(3, job, sweep)
    assert name == "3_pe-rope_n_heads-2_seed-1"  # fixed overrides (d_model) left out, the seed last
    ckpt = f"{sweep}/{name}/checkpoints/step000010-val_loss1.2345.ckpt"
    assert _parse(f"ckpt_path={ckpt}") == ckpt  # pasteable unquoted into any override
    assert _parse(f"eval.checkpoints=[{ckpt},{ckpt}]") == [ckpt, ckpt]
    assert run_label(sweep / name, "rope") == "rope"  # no overrides.yaml yet: the PE alone
    assert run_label(tmp_path, "rope") is None  # not a sweep job
    (sweep / name / ".hydra").mkdir(parents=True)
    (sweep / name / ".hydra" / "overrides.yaml").write_text("\n".join(f"- {o}" for o in job) + "\n")
    assert run_label(sweep / name, "rope") == "rope · n_heads 2 · seed 1"
    assert split_seed("rope · n_heads 2 · seed 1 +yarn") == ("rope · n_heads 2 +yarn", 1)


def test_job_dirname_long_values_keep_every_key(tmp_path):
    sweep = tmp_path / "sweep"
    long = "{type: yarn, factor: 4, original_max_len: 512}"
    _multirun_yaml(sweep, [f"model.pe_options.scaling={long},null", "model.n_heads=2,3"])
    a = job_dirname(0, [f"model.pe_options.scaling={long}", "model.n_heads=2"], sweep, max_len=40)
    b = job_dirname(1, [f"model.pe_options.scaling={long}", "model.n_heads=3"], sweep, max_len=40)
    assert a.endswith("_n_heads-2") and b.endswith("_n_heads-3"), (a, b)  # the varying key is never cut
    assert "scaling-" in a and len(a) <= 40 and not set("=,{}[]: /") & set(a)
    _multirun_yaml(tmp_path / "optuna", ["pe=rope"], params={"optim.lr": "interval(1e-4, 1e-2)"})
    assert swept_keys(tmp_path / "optuna") == ("optim.lr",)  # a sweeper's params count as swept
    assert swept_keys(tmp_path / "none") is None


def test_tensorboard_dir_resume_continues_the_run(tmp_path):
    old = tmp_path / "runs" / "a"
    (old / "tensorboard").mkdir(parents=True)
    assert tensorboard_dir(tmp_path / "b", old / "checkpoints" / "last.ckpt") == str(old / "tensorboard")
    assert tensorboard_dir(tmp_path / "b", None) == str(tmp_path / "b" / "tensorboard")
    assert tensorboard_dir(tmp_path / "b", tmp_path / "x" / "checkpoints" / "l.ckpt").startswith(
        str(tmp_path / "b")
    )


def _sweep_with_failure(tmp_path: Path) -> tuple[Path, dict[str, list[tuple[float, float]]]]:
    sweep = tmp_path / "sweep"
    _multirun_yaml(sweep, ["pe=rope,alibi,t5", "seed=0,1,2", "model.d_model=16"])
    values = {"rope": [(1.0, 0.2), (0.98, 0.4), (0.99, 0.0)], "alibi": [(1.0, 0.9)]}
    num = 0
    for pe, per_seed in values.items():
        for seed, (a, b) in enumerate(per_seed):
            _fake_job(sweep, num, pe, seed, {16: a, 64: b})
            num += 1
    failed = sweep / job_dirname(9, ["pe=t5", "seed=0"], sweep)
    failed.mkdir()
    (failed / "error.txt").write_text("error: model.n_heads=3 must divide model.d_model=16\n")
    return sweep, values


def test_collect_mean_std_labels_and_failures(tmp_path):
    sweep, values = _sweep_with_failure(tmp_path)
    summary = collect(sweep)
    assert (
        summary["groups"] == ["rope", "alibi"]
        and summary["n_runs"] == 4
        and summary["metric"] == "exact_match"
    )
    assert [r["label"] for r in summary["runs"]][:2] == ["rope · seed 0", "rope · seed 1"]
    rows = {(r["group"], r["length"]): r for r in summary["rows"]}
    ood = [b for _, b in values["rope"]]
    assert rows[("rope", 64)]["exact_match_mean"] == pytest.approx(statistics.fmean(ood))
    assert rows[("rope", 64)]["exact_match_std"] == pytest.approx(statistics.stdev(ood))
    assert rows[("rope", 64)]["seeds"] == [0, 1, 2] and not rows[("rope", 64)]["in_distribution"]
    md = (sweep / "summary.md").read_text()
    assert "| model | 16* | 64 |" in md and "| rope | 0.990 ± 0.010 | 0.200 ± 0.200 |" in md
    assert "| alibi | 1.000 | 0.900 |" in md  # one seed: no ±
    assert "9_pe-t5_seed-0: error: model.n_heads=3 must divide" in md and str(sweep / "9_pe-t5_seed-0") in md
    assert (
        (sweep / "summary.csv")
        .read_text()
        .startswith("group,pe,length,in_distribution,n_runs,exact_match_mean")
    )
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert (sweep / "summary.svg").read_text().lstrip().startswith("<?xml")
    assert json.loads((sweep / "summary.json").read_text())["failed"][0]["path"].endswith("error.txt")


def test_sweep_summary_callback_prints_and_exits_nonzero_on_failure(tmp_path, capsys):
    sweep, _ = _sweep_with_failure(tmp_path)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with pytest.raises(SystemExit) as exc:
        SweepSummary().on_multirun_end(config)
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert "0.990 ± 0.010" in out and "summary.md" in out and (sweep / "summary.png").exists()
    assert "1 of 5 sweep jobs failed" in err and "error: model.n_heads=3" in err
    assert str(sweep / "9_pe-t5_seed-0" / "error.txt") in err
    (sweep / "9_pe-t5_seed-0" / "error.txt").unlink()
    SweepSummary().on_multirun_end(config)  # all jobs fine: no exit
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "x")}}}))


def _script():
    spec = importlib.util.spec_from_file_location("collect_sweep", ROOT / "scripts" / "collect_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_collect_script_is_the_library(tmp_path, capsys):
    mod = _script()
    for bad, msg in ((tmp_path, "no results.json under"), (tmp_path / "missing", "is not a directory")):
        with pytest.raises(SystemExit) as exc:
            mod.main([str(bad)])
        assert exc.value.code == 1 and msg in capsys.readouterr().err
    sweep, _ = _sweep_with_failure(tmp_path)
    assert mod.main([str(sweep), "--metric", "token_acc", "--out", str(tmp_path / "o")]) == 1
    assert "token accuracy" in (tmp_path / "o" / "summary.md").read_text()


@pytest.mark.slow  # a multirun subprocess
def test_multirun_names_summary_and_failed_job(tmp_path):
    data = [
        "data.n_train=64",
        "data.n_val=16",
        "data.n_eval_per_length=16",
        "data.batch_size=16",
        "data.train_len=[1,4]",
        "data.eval_lengths=[4,8]",
    ]
    model = ["model.d_model=16", "model.n_layers=1", "model.d_ff=32"]
    args = [
        "-m",
        "pe=rope,alibi",
        "model.n_heads=2,3",
        "debug=fdr",
        f"paths.cache_dir={tmp_path}/cache",
        *data,
        *model,
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # two jobs fail (16 % 3 != 0): non-zero exit
    [sweep] = list((tmp_path / "outputs" / "train" / "multiruns").iterdir())
    names = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert names == [
        "0_pe-rope_n_heads-2",
        "1_pe-rope_n_heads-3",
        "2_pe-alibi_n_heads-2",
        "3_pe-alibi_n_heads-3",
    ]
    assert (
        "2 of 4 sweep jobs failed" in proc.stderr
        and str(sweep / "1_pe-rope_n_heads-3" / "error.txt") in proc.stderr
    )
    assert "rope · n_heads 2" in proc.stdout and "alibi · n_heads 2" in proc.stdout
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["groups"] == ["rope · n_heads 2", "alibi · n_heads 2"] and len(summary["failed"]) == 2
    assert {r["length"] for r in summary["rows"]} == {4, 8} and (sweep / "summary.svg").exists()

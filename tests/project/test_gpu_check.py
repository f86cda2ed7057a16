"""scripts/gpu_check.sh, checked on the CPU so that a short GPU window is not spent on a typo.

- the script parses (``bash -n``);
- its dry run (``--dry-run`` / ``GPU_CHECK_DRY_RUN=1``) lists every stage with its command, creates
  nothing, needs no CUDA, and stage a trains every registered PE (read from the registry at run time);
- the log scanner (``scripts/gpu_check_scan.py``) flags the three failures that exit 0, and the
  script's ``stage`` function (the file sourced) turns them, a non-zero exit, a timeout and a missing
  file into a failed row of the table;
- every override the script passes to ``posformer-train``, ``posformer-eval`` and
  ``posformer-inspect`` composes with Hydra (``trainer=cpu`` for ``trainer=gpu``: it composes here) and
  passes the configs' own checks, for every job of every multirun; the benchmark's flags parse;
- the plan fits a cold machine: the dry run's timeline ends within the global budget, and the budget
  model (``scripts/gpu_budget.py``) puts every stage within its budget from the committed graph
  counts (``tests/fixtures/gpu_budget.json``), which a slow test recounts for some stages;
- stage h's runner (``scripts/gpu_check_tests.py``) keeps a report per module and fails on a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from hydra import compose, initialize_config_module

import posformer
from posformer.configs.settings import read_train
from posformer.eval.settings import read_eval
from posformer.pe import ENCODINGS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_budget  # noqa: E402  (scripts/ is not a package)
import gpu_check_tests  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SCANNER = ROOT / "scripts" / "gpu_check_scan.py"
STAGES = ("setup", "a", "c", "e", "f", "h", "b", "d1", "d2")
COUNTS = ROOT / "tests" / "fixtures" / "gpu_budget.json"
#: the console scripts the stages call -> the Hydra primary config they compose (None: not Hydra)
CLIS = {
    "posformer-train": "train",
    "posformer-eval": "eval",
    "posformer-inspect": "inspect",
    "posformer-bench": None,
}
MODULES = {
    "posformer.cli.train": "posformer-train",
    "posformer.cli.evaluate": "posformer-eval",
    "posformer.cli.inspect": "posformer-inspect",
    "posformer.cli.bench": "posformer-bench",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


def _dry_run(out: Path, *args: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    return out, _dry_run(out, "--dry-run")


def _stages(text: str) -> dict[str, list[str]]:
    """Stage id -> its command's words, from the dry run (``scripts/gpu_budget.py`` reads it so)."""
    return {sid: words for sid, (_, words) in gpu_budget.stage_commands(text).items()}


_cli = gpu_budget.console_args
_jobs = gpu_budget.expand_jobs


# ---------------------------------------------------------------------------------------------- (1)
def test_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------- (2)
def test_dry_run_lists_every_stage_and_runs_nothing(dry_run: tuple[Path, str]) -> None:
    out, text = dry_run
    stages = _stages(text)
    assert set(stages) == set(STAGES), text
    assert all(stages.values())
    assert not out.exists(), "the dry run created the output folder"
    for stage in ("a", "b", "c", "d1", "d2", "e", "f"):
        assert _cli(stages[stage]) is not None, f"stage {stage}: {stages[stage]}"
    # the CUDA test cases, a module at a time
    assert "scripts/gpu_check_tests.py" in stages["h"] and "--cases" in stages["h"]


def test_the_dry_run_timeline_puts_a_and_c_first_and_ends_within_the_global_budget(
    dry_run: tuple[Path, str],
) -> None:
    text = dry_run[1]
    total = gpu_budget.global_budget(text)
    lanes = re.findall(r"^lane (\d+): (.+)$", text, flags=re.M)
    assert len(lanes) == 4 and total == 540
    starts = {}
    for _, items in lanes:
        for item in items.split(", "):
            sid, span = item.split()
            start, end = map(int, span.split("-"))
            starts[sid] = start
            assert end <= total, f"{sid} ends at {end} s, past the global {total} s"
    assert set(starts) == set(STAGES) - {"setup"}
    first = min(starts.values())
    assert starts["a"] == starts["c"] == starts["h"] == first  # the key evidence starts at once


@pytest.mark.slow  # a second dry run of the script (subprocesses); the --dry-run flag's stays fast
def test_dry_run_by_environment_variable_is_the_same(dry_run: tuple[Path, str]) -> None:
    out, text = dry_run
    assert _dry_run(out, GPU_CHECK_DRY_RUN="1") == text


def test_stage_a_trains_every_registered_pe(dry_run: tuple[Path, str]) -> None:
    stages = _stages(dry_run[1])
    cli, args = _cli(stages["a"])  # type: ignore[misc]
    assert cli == "posformer-train" and "-m" in args
    pes = [a.split("=", 1)[1] for a in args if a.startswith("pe=")]
    assert len(pes) == 1 and pes[0].split(",") == posformer.list_encodings()
    assert "trainer=gpu" in args
    assert not any(a.startswith("callbacks") for a in args), "stage a keeps the default callbacks"
    # read from the registry when the script runs, not written into it
    assert pes[0] not in SCRIPT.read_text()


def test_stage_b_runs_the_precisions_stage_a_does_not_for_rope_alibi_t5(dry_run: tuple[Path, str]) -> None:
    _, args = _cli(_stages(dry_run[1])["b"])  # type: ignore[misc]
    assert "pe=rope,alibi,t5" in args
    assert "trainer.precision=32-true,16-mixed,bf16-true" in args  # trainer=gpu (stage a): bf16-mixed


def test_dry_run_on_cpu_swaps_the_device(tmp_path: Path) -> None:
    stages = _stages(_dry_run(tmp_path / "out", "--dry-run", GPU_CHECK_DEVICE="cpu"))
    assert "trainer=cpu" in stages["a"] and "trainer=gpu" not in stages["a"]
    assert "device=cpu" in stages["e"]


# ---------------------------------------------------------------------------------------------- (3)
def _scanner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_scan", SCANNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAILURES = {
    "device mismatch": "RuntimeError: Expected all tensors to be on the same device, but found at least "
    "two devices, cuda:0 and cpu!",
    "graph limit": "posformer-train: error: FlexAttention compiled more than 16 graphs in this process",
    "Flex fallback": "WARNING FlexAttention failed in the flex backend (InductorError: ...); this "
    "model's remaining attention calls take SDPA or the materialised paths",
    "eager FlexAttention": "UserWarning: flex_attention called without torch.compile() - this will use "
    "an unfused implementation that materializes the full scores matrix",
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_scanner_flags_each_failure(kind: str, tmp_path: Path) -> None:
    scan = _scanner()
    text = f"step 1\n{FAILURES[kind]}\nstep 2\n"
    assert [k for k, _, _ in scan.scan_text(text)] == [kind]
    assert scan.scan_text(text)[0][1] == 2  # the line number
    log = tmp_path / "job" / "train.log"
    log.parent.mkdir()
    log.write_text(text)
    done = subprocess.run([sys.executable, str(SCANNER), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout.startswith(f"{kind}: {log}:2: ")


def test_scanner_other_spellings_and_clean_logs(tmp_path: Path) -> None:
    scan = _scanner()
    # torch's own recompile lines are not posformer's limit: a slower function, not a failed stage
    assert scan.scan_text("W1204 torch._dynamo hit config.recompile_limit (8)") == []
    assert scan.scan_text("torch._dynamo.config.cache_size_limit reached") == []
    assert [k for k, _, _ in scan.scan_text("... it MATERIALIZES THE FULL SCORES matrix")] == [
        "eager FlexAttention"
    ]
    assert [k for k, _, _ in scan.scan_text("FlexRecompileError: ...")] == ["graph limit"]
    assert len(scan.scan_text("\n".join(FAILURES.values()))) == 4
    clean = tmp_path / "clean.log"
    clean.write_text("model: decoder, pe=rope\nloss 2.6\nwrote results.json\n")
    (tmp_path / "model.ckpt").write_bytes(FAILURES["device mismatch"].encode())  # not a log: skipped
    done = subprocess.run([sys.executable, str(SCANNER), str(tmp_path)], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "")


def _stage_rows(tmp_path: Path, calls: str) -> dict[str, list[str]]:
    """Source the script (its functions only), run ``calls`` (``stage ...`` lines), return the rows."""
    prelude = f"""
        source {shlex.quote(str(SCRIPT))}
        set_dirs {shlex.quote(str(tmp_path))}
        mkdir -p "$LOGS" "$RUNS" "$STATUS"
        ROOT={shlex.quote(str(ROOT))} PYTHON={shlex.quote(sys.executable)} DRY_RUN=0
        GLOBAL_BUDGET_S=60 MIN_STAGE_S=2 DEADLINE=$((SECONDS + 60)) ORDER=()
    """
    done = subprocess.run(
        ["bash", "-c", prelude + calls], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {p.stem: p.read_text().rstrip("\n").split("\t") for p in (tmp_path / "work" / "status").iterdir()}


def test_stage_judges_exit_status_patterns_timeouts_and_files(tmp_path: Path) -> None:
    rows = _stage_rows(
        tmp_path,
        """
        stage ok "fine" 20 bash -c 'echo all good'
        stage exit "exit 3" 20 bash -c 'echo bad; exit 3'
        stage mismatch "device mismatch" 20 bash -c 'echo "Expected all tensors to be on the same device"'
        stage recompile "graph limit" 20 bash -c 'echo "error: FlexAttention compiled more than 16 graphs"'
        stage torchs "torch's limit" 20 bash -c 'echo "torch._dynamo hit config.recompile_limit (8)"'
        stage eager "eager flex" 20 bash -c 'echo "flex_attention called without torch.compile()" >&2'
        mkdir -p "$RUNS/inrun/0" && echo "materializes the full scores matrix" > "$RUNS/inrun/0/train.log"
        stage inrun "a run's log" 20 true
        stage slow "hangs" 2 sleep 30
        EXPECT=("summary.md" "*/results.json#2")
        mkdir -p "$RUNS/files/0" && touch "$RUNS/files/summary.md" "$RUNS/files/0/results.json"
        stage files "one results.json of two" 20 true
        EXPECT=("summary.md")
        mkdir -p "$RUNS/present" && touch "$RUNS/present/summary.md"
        stage present "expected file there" 20 true
        DEADLINE=$SECONDS
        stage late "after the global budget" 20 true
        """,
    )
    status = {stage: row[1] for stage, row in rows.items()}
    assert status == {
        "ok": "passed",
        "exit": "FAILED",
        "mismatch": "FAILED",
        "recompile": "FAILED",
        "torchs": "passed",
        "eager": "FAILED",
        "inrun": "FAILED",
        "slow": "TIMEOUT",
        "files": "FAILED",
        "present": "passed",
        "late": "SKIPPED",
    }
    assert rows["exit"][3] == "exit 3"
    assert "device mismatch" in rows["mismatch"][3]
    assert "graph limit" in rows["recompile"][3]
    assert "eager FlexAttention" in rows["eager"][3] and "eager FlexAttention" in rows["inrun"][3]
    assert "*/results.json (1 of 2)" in rows["files"][3]
    assert int(rows["slow"][2]) < 15  # killed at its budget, not after the 30 s sleep
    assert (tmp_path / "work" / "logs" / "exit.log").read_text() == "bad\n"


def _live_in_group(group: int) -> list[int]:
    """The pids of the processes of process group ``group`` that are not zombies (Linux /proc)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_interrupt_stops_the_running_stage(tmp_path: Path) -> None:
    """TERM (or Ctrl-C) stops the stage's whole process group and keeps the table."""
    script = f"""
        source {shlex.quote(str(SCRIPT))}
        set_dirs {shlex.quote(str(tmp_path))}
        mkdir -p "$LOGS" "$RUNS" "$STATUS"
        ROOT={shlex.quote(str(ROOT))} PYTHON={shlex.quote(sys.executable)} DRY_RUN=0
        GLOBAL_BUDGET_S=60 MIN_STAGE_S=2 DEADLINE=$((SECONDS + 60)) ORDER=(x)
        trap on_interrupt INT TERM
        stage x "sleeps" 50 bash -c 'sleep 40; echo done'
    """
    proc = subprocess.Popen(["bash", "-c", script], env=_env(), stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "work" / "status" / "x.pid"
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    group = int(pid_file.read_text())
    time.sleep(0.3)
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in err
    for _ in range(100):  # no live process of the stage is left (zombies may wait for their reaper)
        if not _live_in_group(group):
            break
        time.sleep(0.05)
    assert not _live_in_group(group)
    assert "| x sleeps | INTERRUPTED |" in (tmp_path / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------- (4)
def _composable(stages: dict[str, list[str]]) -> list[tuple[str, str, list[str]]]:
    """(stage, console script, job overrides) of every job of every Hydra stage, trainer=gpu -> cpu."""
    jobs = []
    for stage, words in stages.items():
        found = _cli(words)
        if found is None or CLIS[found[0]] is None:
            continue
        cli, args = found
        for job in _jobs(args):
            jobs.append((stage, cli, ["trainer=cpu" if o == "trainer=gpu" else o for o in job]))
    return jobs


@pytest.mark.slow
def test_every_override_composes(dry_run: tuple[Path, str], tmp_path: Path) -> None:
    from posformer.cli.inspect import compose_config

    stages = _stages(dry_run[1])
    jobs = _composable(stages)
    n_pes = len(posformer.list_encodings())
    counts = {s: sum(1 for j in jobs if j[0] == s) for s in ("a", "b", "c", "d1", "d2", "e", "f")}
    assert counts == {"a": n_pes, "b": 9, "c": 1, "d1": 1, "d2": 1, "e": 3, "f": 2}
    text = tmp_path / "lm.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}"]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        for _, cli, overrides in jobs:
            if cli == "posformer-inspect":
                continue
            cfg = compose(CLIS[cli], overrides=[*overrides, *paths])  # hydra.* overrides checked too
            if cli == "posformer-train":
                if cfg.data.name == "text":  # the script writes its text when it runs: one stands in
                    cfg.data.path = str(text)
                read_train(cfg)
                assert cfg.trainer.max_steps > 0 and cfg.trainer.val_check_interval <= cfg.trainer.max_steps
            else:
                read_eval(cfg, "extrapolate")
                assert cfg.eval.rope_scaling[0] is None and cfg.eval.rope_scaling[1].type == "yarn"
    for _, cli, overrides in jobs:  # compose_config: posformer-inspect's own check (builds the PE)
        if cli == "posformer-inspect":
            assert "device=cuda" in overrides  # on the GPU; composed here on the CPU
            compose_config(["device=cpu" if o == "device=cuda" else o for o in overrides])


CASES = ROOT / "scripts" / "gpu_check_cases.txt"


def test_the_cases_touch_every_cuda_path_in_about_twenty() -> None:
    cases = gpu_check_tests.read_cases(CASES)
    assert 16 <= len(cases) <= 24 and len(set(cases)) == len(cases)
    assert all("::test_cuda_" in c and (ROOT / c.split("::")[0]).is_file() for c in cases)
    flex_cases = [c for c in cases if "test_cuda_flex_equals_sdpa_forward_and_gradients[" in c]
    for part in ("-causal-", "-bidirectional-", "-none-", "-padding-", "-documents-", "-fp32]", "-bf16]"):
        assert any(part in c for c in flex_cases), part
    modules = {Path(c.split("::")[0]).stem for c in cases}
    assert modules >= {
        "test_flex_learned",  # learned biases' gradients through Flex
        "test_flex_features",  # a bias of the layer input (forget gates)
        "test_shaw_training",  # Shaw's shortcut on compiled Flex
        "test_cope_training",  # CoPE's training function
        "test_keycol",  # key columns of fused SDPA
        "test_pe_precision",  # positions under bf16 autocast
        "test_host_sync",  # no host sync in a training step
        "test_small_heads",  # heads Flex refuses
        "test_flex_fallback",  # a failure that slows a run instead of ending it
    }


@pytest.mark.slow  # a pytest --collect-only subprocess over the listed modules (~6 s)
def test_every_listed_case_is_collected_and_cuda_marked() -> None:
    cases = gpu_check_tests.read_cases(CASES)
    collect = ["--collect-only", "-q", "-o", "addopts=--strict-markers", "-m", "cuda"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *collect, *cases],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line for line in done.stdout.splitlines() if "::" in line] == cases


def test_the_runner_keeps_a_report_per_module_and_fails_on_a_failure(tmp_path: Path) -> None:
    (tmp_path / "test_good.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("def test_ok():\n    pass\n\ndef test_wrong():\n    assert 0\n")
    cases = tmp_path / "cases.txt"
    cases.write_text(
        f"# a comment\n{tmp_path}/test_good.py::test_one\n{tmp_path}/test_bad.py::test_wrong\n\n"
        f"{tmp_path}/test_good.py::test_two\n{tmp_path}/test_bad.py::test_ok\n"
    )
    out = tmp_path / "out"
    runner = [sys.executable, str(ROOT / "scripts" / "gpu_check_tests.py")]
    done = subprocess.run(
        [*runner, str(out), "--cases", str(cases), "--jobs", "2", "--", "-W", "error::UserWarning"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("test_good: passed (2 passed") for line in lines), lines
    assert any(line.startswith("test_bad: FAILED (1 passed, 1 failed") for line in lines), lines
    assert lines[-1].startswith("tests=4 passed=3 failures=1") and "modules failed: test_bad" in lines[-1]
    files = {p.name for p in out.iterdir()}
    assert files == {"test_good.xml", "test_good.log", "test_bad.xml", "test_bad.log"}
    assert "test_good.py::test_one PASSED" in (out / "test_good.log").read_text()  # -v: a line per test


# ---------------------------------------------------------------------------------------------- (5)
def test_the_budget_model_puts_every_stage_within_its_budget(dry_run: tuple[Path, str]) -> None:
    """From the committed graph counts (``python scripts/gpu_budget.py --write
    tests/fixtures/gpu_budget.json`` after a change to the check or to what compiles), every stage's cold
    estimate is within its budget and each lane's budgets within the global one."""
    text = dry_run[1]
    stages = gpu_budget.plan(text)
    saved = json.loads(COUNTS.read_text())
    counts = {sid: {u: gpu_budget.Counts(**c) for u, c in units.items()} for sid, units in saved.items()}
    assert set(counts) == {s.id for s in stages}, "the counts are of another plan: write them again"
    training = {s.id for s in stages if (_cli(s.words) or ("",))[0] == "posformer-train"}
    for stage in stages:  # a unit per training job, per test module
        units = gpu_check_tests.by_module(stage.cases) if stage.cases else stage.jobs * (stage.id in training)
        assert len(counts[stage.id]) == len(units), stage.id
    table, ok = gpu_budget.table(stages, counts, gpu_budget.global_budget(text))
    assert ok, table
    # the model is not vacuous: the previous plan's stage h (every CUDA test) would not have fitted
    cases = [f"tests/test_x.py::test_cuda_{i}" for i in range(97)]
    many = gpu_budget.Stage("h", 180, 3, [], cases=cases, workers=8)
    heavy = gpu_budget.Counts(backward=[str(i) for i in range(90)], masks=[str(i) for i in range(90)])
    assert gpu_budget.estimate(many, {"tests/test_x.py": heavy}) > many.budget


@pytest.mark.slow  # counts the graphs of stages c and f on the CPU (~30 s)
def test_the_committed_graph_counts_are_todays(tmp_path: Path, dry_run: tuple[Path, str]) -> None:
    import warnings

    saved = json.loads(COUNTS.read_text())
    stages = {s.id: s for s in gpu_budget.plan(dry_run[1])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sid in ("c", "f"):
            units = gpu_budget.count_stage(stages[sid], tmp_path)
            counted = {u: {k: sorted(v) for k, v in vars(c).items()} for u, c in units.items()}
            assert counted == {u: {k: sorted(v) for k, v in c.items()} for u, c in saved[sid].items()}, sid


# ---------------------------------------------------------------------- scripts/gpu_speed.sh
SPEED = ROOT / "scripts" / "gpu_speed.sh"
SPEED_STAGES = ("q", "t", "tr", "fo", "kc", "fd", "sh", "ev", "m1", "m2", "mc")


@pytest.fixture(scope="module")
def speed_dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    out = tmp_path_factory.mktemp("gpu_speed") / "out"
    subprocess.run(["bash", "-n", str(SPEED)], check=True, timeout=30)
    done = subprocess.run(
        ["bash", str(SPEED), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return out, _stages(done.stdout)


def test_speed_dry_run_lists_every_stage_and_creates_nothing(speed_dry_run: tuple[Path, dict]) -> None:
    out, stages = speed_dry_run
    assert tuple(stages) == SPEED_STAGES
    assert not out.exists()


def _speed(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``gpu_speed.sh`` for real with ``env``; every stage's command is ``true`` (PYTHON=true): the
    script's own logic (order, budget, summary) runs, nothing is measured."""
    return subprocess.run(
        ["bash", str(SPEED), str(out)],
        capture_output=True,
        text=True,
        env={**_env(**env), "PYTHON": "true"},
        timeout=60,
        cwd=ROOT,
    )


def test_speed_stages_run_in_the_order_asked_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SPEED_")}
    done = subprocess.run(
        ["bash", str(SPEED), "--dry-run"],
        capture_output=True,
        text=True,
        env={**env, "GPU_SPEED_STAGES": "m2,tr,ev"},
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert list(_stages(done.stdout)) == ["m2", "tr", "ev"]
    bad = _speed(tmp_path / "bad", GPU_SPEED_STAGES="tr,train")
    assert bad.returncode == 2 and "unknown stage 'train'" in bad.stderr
    assert "q,t,tr,fo,kc,fd,sh,ev" in bad.stderr
    assert not (tmp_path / "bad").exists()
    bad = _speed(tmp_path / "bad", GPU_SPEED_BUDGET_S="4min")
    assert bad.returncode == 2 and "GPU_SPEED_BUDGET_S=4min" in bad.stderr


def test_the_global_budget_skips_what_it_cannot_fit(tmp_path: Path) -> None:
    """With 100 s the first stage runs (its timeout cut to what is left) and passes; with 20 s left
    no stage starts: each is a SKIPPED row and the exit status says the run is incomplete."""
    ran = _speed(tmp_path / "ran", GPU_SPEED_STAGES="tr,ev", GPU_SPEED_BUDGET_S="100")
    rows = (tmp_path / "ran" / "summary.md").read_text()
    assert ran.returncode == 0 and "| tr | passed |" in rows and "| ev | passed |" in rows, rows
    short = _speed(tmp_path / "short", GPU_SPEED_STAGES="tr,ev", GPU_SPEED_BUDGET_S="20")
    rows = (tmp_path / "short" / "summary.md").read_text()
    assert short.returncode == 1 and rows.index("| tr | SKIPPED |") < rows.index("| ev | SKIPPED |"), rows


def test_speed_bench_commands_parse_and_measure_the_issues_targets(speed_dry_run: tuple[Path, dict]) -> None:
    from posformer.cli.bench import parse_args

    _, stages = speed_dry_run
    cfgs = {}
    quick = parse_args(_cli(stages["q"])[1])  # type: ignore[index]  # the smoke test of every PE and section
    assert quick.device == "cuda" and quick.d_model <= 64 and quick.out.endswith("/q")
    for sid in SPEED_STAGES[2:]:
        cli, args = _cli(stages[sid])  # type: ignore[misc]
        assert cli == "posformer-bench"
        cfgs[sid] = cfg = parse_args(args)
        assert cfg.device == "cuda" and cfg.dtype == "bf16" and cfg.attention_backend == "auto"
        assert cfg.out.endswith("/" + sid)
    tr = cfgs["tr"]
    assert (tr.d_model, tr.n_heads, tr.n_layers, tr.seq_len, tr.batch) == (1024, 16, 4, 2048, 4)
    assert tr.sections == ["train"] and tr.pes[0] == "nope"
    biases = [n for n in posformer.list_encodings() if "bias" in ENCODINGS[n].capabilities.hooks]
    assert set(biases) <= set(tr.pes)  # every bias PE against nope in one run
    ev = cfgs["ev"]  # every PE at 64k, side by side with ALiBi
    assert ev.eval_lengths == [16384, 65536] and set(ev.pes) == set(posformer.list_encodings())
    fo = cfgs["fo"]  # Flex's two forms of an offset-only bias, side by side, the tr model
    assert fo.pes == ["alibi", "t5", "kerple"] and fo.before == ["flex_offsets"] and fo.d_model == tr.d_model
    kc = cfgs["kc"]  # the key biases through Flex against their columns of fused SDPA, the tr model
    assert kc.pes == ["alibi", "forget_alibi"] and kc.before == ["flex"] and kc.d_model == tr.d_model
    fd = cfgs["fd"]  # Flex told the lengths divide by 128, against its bounds checks, at the tr length
    assert fd.pes == ["alibi", "t5", "fire"] and fd.before == ["flex_divisible"] and fd.seq_len % 128 == 0
    sh = cfgs["sh"]  # Shaw's and CoPE's own training attention against the explicit/masked path, tr model
    assert sh.pes == ["shaw", "cope"] and list(sh.before) == ["shortcut"] and sh.d_model == tr.d_model
    for sid, width, layers in (("m1", 1024, 4), ("m2", 2048, 8), ("mc", 2048, 8)):
        cfg = cfgs[sid]
        assert cfg.sections == ["mfu"] and cfg.mfu_d_models == [width] and cfg.n_layers == layers
        assert cfg.seq_len == 2048 and {"nope", "rope", "alibi", "t5"} <= set(cfg.mfu_pes)
        assert cfg.compile is (sid == "mc")


@pytest.mark.slow  # a pytest --collect-only subprocess over the CUDA test files (~6 s)
def test_speed_test_stage_collects_the_cuda_tests(speed_dry_run: tuple[Path, dict]) -> None:
    """Stage t collects the learned-bias gradient tests and the fused-optimiser test, and only CUDA ones."""
    words = speed_dry_run[1]["t"]
    args = [w for w in words[words.index("pytest") + 1 :] if w != "-q"]
    args = args[: args.index("--junitxml")]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=--strict-markers", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and all("::test_cuda_" in i for i in ids), ids
    assert any("test_flex_learned.py" in i and "bf16" in i for i in ids)
    assert any("test_bench_mfu.py" in i for i in ids)

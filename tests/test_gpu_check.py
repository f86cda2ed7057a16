"""scripts/gpu_check.sh, checked on the CPU so that a short GPU window is not spent on a typo.

- the script parses (``bash -n``);
- its dry run (``--dry-run`` / ``GPU_CHECK_DRY_RUN=1``) lists every stage with its command, creates
  nothing, needs no CUDA, and stage a trains every registered PE (read from the registry at run time);
- the log scanner (``scripts/gpu_check_scan.py``) flags the three failures that exit 0, and the
  script's ``stage`` function (the file sourced) turns them, a non-zero exit, a timeout and a missing
  file into a failed row of the table;
- every override the script passes to ``posformer-train``, ``posformer-eval`` and
  ``posformer-inspect`` composes with Hydra (``trainer=cpu`` for ``trainer=gpu``: it composes here) and
  passes the configs' own checks, for every job of every multirun; the benchmark's flags parse.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import posformer
from posformer.config import validate_config
from posformer.eval.settings import check_eval_config
from posformer.pe import ENCODINGS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SCANNER = ROOT / "scripts" / "gpu_check_scan.py"
STAGES = ("setup", "a", "b", "c", "d1", "d2", "e", "f", "g", "h")
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
    """Stage id -> its command's words, from the dry run's ``== ID (N s): title`` / ``   $ cmd`` lines."""
    stages: dict[str, list[str]] = {}
    current = None
    lines = iter(text.splitlines())
    for line in lines:
        m = re.match(r"^== (\S+) \((\d+) s\): ", line)
        if m:
            current = m.group(1)
        elif line.startswith("   $ ") and current is not None:
            command = line[5:]
            while True:  # a quoted argument may span lines (the setup script)
                try:
                    stages[current] = shlex.split(command)
                    break
                except ValueError:
                    command += "\n" + next(lines)
            current = None
    return stages


def _cli(words: list[str]) -> tuple[str, list[str]] | None:
    """(console script, its arguments) of a stage command, or None for other commands."""
    for i, word in enumerate(words):
        if Path(word).name in CLIS:
            return Path(word).name, words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1] in MODULES:
            return MODULES[words[i + 1]], words[i + 2 :]
    return None


def _jobs(overrides: list[str]) -> Iterator[list[str]]:
    """Every job of a multirun: sweeps (``pe=a,b``) expanded into their product."""
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            choices.append([f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    yield from (list(job) for job in itertools.product(*choices))


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
    for stage in ("a", "b", "c", "d1", "d2", "e", "f", "g"):
        assert _cli(stages[stage]) is not None, f"stage {stage}: {stages[stage]}"
    # the CUDA tests: the trimmed selection
    assert "cuda and not slow" in stages["h"] and "pytest" in stages["h"]


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


def test_stage_b_runs_five_precisions_for_rope_alibi_t5(dry_run: tuple[Path, str]) -> None:
    _, args = _cli(_stages(dry_run[1])["b"])  # type: ignore[misc]
    assert "pe=rope,alibi,t5" in args
    assert "trainer.precision=32-true,16-mixed,bf16-mixed,bf16-true,16-true" in args


def test_dry_run_on_cpu_swaps_the_device(tmp_path: Path) -> None:
    stages = _stages(_dry_run(tmp_path / "out", "--dry-run", GPU_CHECK_DEVICE="cpu"))
    assert "trainer=cpu" in stages["a"] and "trainer=gpu" not in stages["a"]
    assert stages["g"][stages["g"].index("--device") + 1] == "cpu"


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
    "recompile limit": "W1204 torch._dynamo hit config.recompile_limit (8)",
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
    assert [k for k, _, _ in scan.scan_text("torch._dynamo.config.cache_size_limit reached")] == [
        "recompile limit"
    ]
    assert [k for k, _, _ in scan.scan_text("... it MATERIALIZES THE FULL SCORES matrix")] == [
        "eager FlexAttention"
    ]
    assert [k for k, _, _ in scan.scan_text("error: FlexAttention compiled more than 16 graphs")] == [
        "recompile limit"
    ]
    assert len(scan.scan_text("\n".join(FAILURES.values()))) == 3
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
        stage recompile "recompile limit" 20 bash -c 'echo "torch._dynamo hit config.recompile_limit (8)"'
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
        "eager": "FAILED",
        "inrun": "FAILED",
        "slow": "TIMEOUT",
        "files": "FAILED",
        "present": "passed",
        "late": "SKIPPED",
    }
    assert rows["exit"][3] == "exit 3"
    assert "device mismatch" in rows["mismatch"][3]
    assert "recompile limit" in rows["recompile"][3]
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


def test_every_override_composes(dry_run: tuple[Path, str], tmp_path: Path) -> None:
    from posformer.cli.inspect import compose_config

    stages = _stages(dry_run[1])
    jobs = _composable(stages)
    n_pes = len(posformer.list_encodings())
    counts = {s: sum(1 for j in jobs if j[0] == s) for s in ("a", "b", "c", "d1", "d2", "e", "f")}
    assert counts == {"a": n_pes, "b": 15, "c": 1, "d1": 1, "d2": 1, "e": 3, "f": 2}
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
                validate_config(cfg)
                assert cfg.trainer.max_steps > 0 and cfg.trainer.val_check_interval <= cfg.trainer.max_steps
            else:
                check_eval_config(OmegaConf.to_container(cfg.eval, resolve=True))
                assert cfg.eval.rope_scaling[0] is None and cfg.eval.rope_scaling[1].type == "yarn"
    for _, cli, overrides in jobs:  # compose_config: posformer-inspect's own check (builds the PE)
        if cli == "posformer-inspect":
            assert "device=cuda" in overrides  # on the GPU; composed here on the CPU
            compose_config(["device=cpu" if o == "device=cuda" else o for o in overrides])


def test_bench_flags_parse(dry_run: tuple[Path, str]) -> None:
    from posformer.cli.bench import parse_args

    cli, args = _cli(_stages(dry_run[1])["g"])  # type: ignore[misc]
    assert cli == "posformer-bench" and "--quick" in args
    cfg = parse_args(args)
    assert cfg.device == "cuda" and cfg.d_model <= 64  # the --quick preset


@pytest.mark.slow
def test_cuda_selection_collects_the_trimmed_tests(dry_run: tuple[Path, str]) -> None:
    """Stage h's pytest selection collects the trimmed CUDA tests (skipped here), and nothing else."""
    words = _stages(dry_run[1])["h"]
    args = iter(words[words.index("pytest") + 1 :])
    keep = []
    for arg in args:
        if arg in ("--junitxml", "-n"):  # and its value: no report, no workers for a collection
            next(args)
        elif arg != "-q":
            keep.append(arg)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=--strict-markers", *keep],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and all("::test_cuda_" in i for i in ids), ids
    cuda_pes = [n for n in posformer.list_encodings() if ENCODINGS[n].capabilities.elementwise_bias]
    cuda_pes.append("nope")
    cases = [i for i in ids if "test_flex.py::test_cuda_flex_equals_sdpa_forward_and_gradients[" in i]
    assert len(cases) == 3 * len(cuda_pes)  # one per PE and mask kind
    # the kernel told IS_DIVISIBLE at 256 tokens = the one with bounds checks: four kinds of bias and mask
    assert sum("test_flex.py::test_cuda_divisible_lengths" in i for i in ids) == 4
    # the learned biases' parameter gradients through Flex, fp32 and bf16, every learned bias
    learned = [i for i in ids if "test_flex_learned.py" in i]
    for part in ("[t5-", "[kerple-", "[fire-", "[dpb-", "-fp32]", "-bf16]", "-documents-"):
        assert any(part in i for i in learned), part
    assert {re.search(r"\[(\w+)-", i).group(1) for i in cases} == set(cuda_pes)  # type: ignore[union-attr]
    for part in ("-causal-", "-bidirectional-", "-none-", "-padding-", "-documents-", "-fp32]", "-bf16]"):
        assert any(part in i for i in cases), part


# ---------------------------------------------------------------------- scripts/gpu_speed.sh (issue 35)
SPEED = ROOT / "scripts" / "gpu_speed.sh"
SPEED_STAGES = ("t", "tr", "fo", "kc", "fd", "sh", "ev", "m1", "m2", "mc")


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
    assert "t,tr,fo,kc,fd,sh,ev" in bad.stderr
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
    for sid in SPEED_STAGES[1:]:
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

"""Every command of the README's usage block, run as written plus tiny overrides.

The ```bash block under ``## Usage`` is parsed line by line (comments dropped, ``shlex`` quoting).
Placeholders come from earlier commands: ``<run>``/``<ckpt>`` from a tiny default run,
``<date_time>`` from the sweep of the block. Each ``posformer-*`` command gets :data:`TINY` (1 layer,
d_model 16, 4 steps) appended, so the README's own values (warm-up, validation interval, lengths)
meet a short run. Commands that need ``../shared`` data or x-transformers are skipped when those
are absent. Runs in a temporary working directory (``scripts/`` linked in). Independent commands run
two at a time; dependent ones (a sweep and its summaries, the reproduction and its translation) in
order within one chain.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHARED = REPO.parent / "shared" / "data"
#: appended to every posformer-train command (and passed to the training script)
TINY_MODEL = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]
TINY_DATA = ["data.n_train=64", "data.n_val=16", "data.n_eval_per_length=8", "data.batch_size=16"]
TINY = [*TINY_MODEL, "trainer.max_steps=4", "logger=none", "callbacks.pe_heatmap=null", "torch_threads=1"]
#: extra overrides per command (a regex on the README line -> overrides after TINY)
EXTRA = {
    r"experiment=lm_shakespeare": [
        "data.block_size=32",
        "data.batch_size=4",
        "data.eval_lengths=[32,64]",
        "data.eval_tokens=256",
        "data.val_tokens=256",
    ],
    r"experiment=transformer_base": [],
    r"^posformer-train(?!.*experiment=)": [*TINY_DATA, "data.train_len=[1,4]", "data.eval_lengths=[4,8]"],
    r"trainer=ddp": ["data.n_val=32"],  # two validation batches: one per process
    r"experiment=ablation": [*TINY_DATA, "data.train_len=[1,4]", "data.eval_lengths=[4,8]"],
    r"\+variant=": ["model.n_layers=2"],  # irope's pattern (rope, nope) needs two layers
    r"reproduce_multi30k": [
        "model.n_encoder_layers=1",
        "model.n_decoder_layers=1",
        "data.vocab_size=300",
        "trainer.max_steps=6",
        "callbacks.periodic_checkpoint.every_n_train_steps=1",
        "trainer.val_check_interval=6",
    ],
    r"ckpt_path=": ["trainer.max_steps=6"],  # resume the 4-step run up to step 6
    r"^posformer-eval eval=extrapolate": ["eval.max_batches=1", "eval.n_tokens=64", "eval.windows_at_max=1"],
    r"eval=translate": ["eval.limit=4", "eval.beam_size=2"],
    r"attention_probe=true": ["max_len=8"],  # the tiny run's validation sequences are 9 tokens
}


def usage_commands() -> list[str]:
    """The command lines of the README's usage block (comments and blank lines dropped)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Usage.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [shlex.join(words) for words in lines if words]


def test_usage_block_is_found():
    cmds = usage_commands()
    assert any(c.startswith("posformer-train -m") for c in cmds) and any("posformer-eval" in c for c in cmds)


def _needs(cmd: str) -> str | None:
    """Why ``cmd`` cannot run here (missing data or package), else ``None``."""
    if "../shared" in cmd and not SHARED.is_dir():
        return "../shared data is absent"
    if ("multi30k" in cmd or "eval=translate" in cmd) and not (SHARED / "multi30k").is_dir():
        return "Multi30k (../shared/data/multi30k) is absent"
    if "scripts/bench.py" in cmd and importlib.util.find_spec("x_transformers") is None:
        return "x-transformers is not installed (pip install -e '.[bench]')"
    if "scripts/bench.py" in cmd:
        return "the full benchmark takes many minutes (make bench)"
    return None


def _tail(cmd: str) -> list[str]:
    tail = list(TINY) if re.match(r"^(posformer-train|scripts/reproduce)", cmd) else []
    if re.search(r"reproduce_multi30k|experiment=transformer_", cmd):  # encoder-decoders: no n_layers
        tail.remove("model.n_layers=1")
    for pattern, extra in EXTRA.items():
        if re.search(pattern, cmd):
            tail += extra
    return tail


def _newest(path: Path) -> Path:
    return max(path.iterdir(), key=lambda p: p.stat().st_mtime)


@pytest.mark.slow
def test_every_usage_command_runs_at_a_tiny_size(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "scripts").symlink_to(REPO / "scripts")
    if SHARED.is_dir():  # ../shared/data as seen from the working directory
        (tmp_path / "shared").symlink_to(SHARED.parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "POSFORMER_ROOT": str(work),
        "POSFORMER_DATA": str(tmp_path / "shared" / "data"),
        "COLUMNS": "120",
    }

    def sh(cmd: str, extra: list[str]) -> subprocess.CompletedProcess:
        words = shlex.split(cmd)
        if words[0] == "python":
            words[0] = sys.executable
        call_env = (
            {**env, "RUN": str(work / "outputs" / "reproduce")} if words[0].startswith("scripts/") else env
        )
        flags = next((i for i, w in enumerate(words) if i and w.startswith("-") and w != "-m"), len(words))
        words = [*words[:flags], *extra, *words[flags:]]  # overrides before trailing flags (--cfg job)
        return subprocess.run(words, cwd=work, env=call_env, capture_output=True, text=True, timeout=900)

    base = sh("posformer-train", _tail("posformer-train"))  # the <run> of the placeholders
    assert base.returncode == 0, base.stderr[-3000:]
    run = _newest(work / "outputs" / "train" / "runs")
    places = {"<run>": run.name, "<ckpt>": str(run / "checkpoints" / "last.ckpt")}
    failures, skipped = [], []

    def run_chain(chain: list[str]) -> None:
        """The commands of one chain in order (a later one may read an earlier one's outputs)."""
        for cmd in chain:
            if "eval=translate" in cmd:
                cmd = cmd.replace("<run>", str(work / "outputs" / "reproduce"))
            if "<date_time>" in cmd:  # the newest sweep: only the sweep chain makes sweeps
                cmd = cmd.replace("<date_time>", _newest(work / "outputs" / "train" / "multiruns").name)
            for key, value in places.items():
                cmd = cmd.replace(key, value)
            out = sh(cmd, _tail(cmd))
            if out.returncode != 0:
                failures.append(f"{cmd}\n{(out.stdout + out.stderr)[-1500:]}")

    runnable = []
    for cmd in usage_commands():
        why = _needs(cmd)
        if why:
            skipped.append(f"{cmd}: {why}")
        else:
            runnable.append(cmd)
    # chains of dependent commands (sweeps -> their summaries; the reproduction -> its translation);
    # every other command is a chain of its own. Two chains at a time (2 cores; runs have their own dirs)
    sweeps = [c for c in runnable if " -m " in f"{c} " or "<date_time>" in c]
    translation = [c for c in runnable if "reproduce_multi30k" in c or "eval=translate" in c]
    chains = [sweeps, translation] + [[c] for c in runnable if c not in sweeps and c not in translation]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run_chain, [c for c in chains if c]))
    assert not failures, "\n\n".join(failures)
    print("skipped:", *skipped, sep="\n  ")

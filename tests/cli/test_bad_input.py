"""Bad-input catalogue: every case goes through a real entry point (``posformer.cli.train.main`` /
``posformer.cli.evaluate.main`` in-process with ``sys.argv`` patched, a few as subprocesses) and must

* exit non-zero,
* print one clear message naming the value, the limit or rule, and a fix (no traceback),
* leave files written before (an earlier ``results.json`` and checkpoint in the output dir) unchanged.

See docs/reliability.md for the table of guarantees.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.cli_cases import (
    SENTINEL_RESULTS,
    TEXT_TINY,
    TINY,
    assert_clean_failure,
    assert_untouched,
    call,
    eval_cli,
    train_cli,
)

# ------------------------------------------------------------------------------------------ config values
CONFIG_CASES = {
    # name: (overrides, text that must appear)
    "unknown_pe": (["pe=rotary"], "Could not find 'pe/rotary'"),
    "unknown_model": (["model=gpt5"], "Could not find 'model/gpt5'"),
    "unknown_data": (["data=imagenet"], "Could not find 'data/imagenet'"),
    "unknown_experiment": (["experiment=nope"], "Could not find 'experiment/nope'"),
    "unknown_task": (["data.task=juggle"], "data.task='juggle' is unknown; valid tasks:"),
    "d_model_not_divisible": (
        ["model.d_model=30", "model.n_heads=4"],
        "model.d_model=30 is not divisible by",
    ),
    "rope_odd_head_dim": (["pe=rope", "model.d_model=6", "model.n_heads=2"], "head_dim 3"),
    "sinusoidal_odd_d_model": (["pe=sinusoidal", "model.d_model=15", "model.n_heads=3"], "15"),
    "zero_train_len": (["data.train_len=[0,4]"], "train_len"),
    "zero_batch_size": (["data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
    "negative_steps": (["trainer.max_steps=-5"], "trainer.max_steps=-5 must be a positive integer"),
    "learned_table_too_short": (["pe=learned", "model.pe_options.max_len=3"], "represents 3 positions"),
    "eval_lengths_not_increasing": (["data.eval_lengths=[8,4]"], "must be strictly increasing"),
    "eval_lengths_below_one": (["data.eval_lengths=[0,4]"], "non-positive lengths [0]"),
    # an absurd evaluation length, refused up front with what one window would cost
    "eval_lengths_absurd": (["data.eval_lengths=[8,10000000]"], "above 1048576 (the limit of the evaluation"),
    "unknown_precision": (["trainer.precision=17-mixed"], "trainer.precision='17-mixed' is unknown; valid:"),
    "wrong_type_override": (["model.d_model=abc"], "d_model"),
    "optim_fused_not_bool": (["optim.fused=maybe"], "optim.fused"),
    "matmul_precision_unknown": (["float32_matmul_precision=fast"], "float32_matmul_precision='fast'"),
    "fsdp_on_the_cpu": (["trainer=fsdp", "trainer.accelerator=cpu"], "trainer.strategy=fsdp needs CUDA GPUs"),
    # keys no code reads: the closest valid key is the fix
    "stray_trainer_key": (["+trainer.max_step=10"], "did you mean trainer.max_steps?"),
    "stray_optim_key": (["+optim.weight_decy=0.1"], "did you mean optim.weight_decay?"),
    "stray_schedule_key": (["+schedule.warmup=10"], "did you mean schedule.warmup_steps?"),
    "stray_data_key": (["+data.batchsize=8"], "did you mean data.batch_size?"),
    "stray_model_key": (["+model.n_layer=2"], "did you mean model.n_layers?"),
    # seeds numpy's RNG does not accept
    "seed_too_large": (["seed=4294967296"], "seed=4294967296 must be a non-negative integer below 2**32"),
    "seed_negative": (["seed=-1"], "seed=-1 must be a non-negative integer below 2**32"),
    "data_seed_too_large": (["data.seed=4294967296"], "data.seed=4294967296 must be a non-negative integer"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_value(case, out_dir, cache_dir, monkeypatch, capsys):
    overrides, needle = CONFIG_CASES[case]
    code, text = train_cli(overrides, out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, needle)
    if case.startswith("unknown_") and case not in ("unknown_task", "unknown_precision"):
        assert "Available options" in text  # Hydra lists the valid choices
    elif "error:" not in text:
        pytest.fail(f"no 'error:' line in {text[-1500:]}")
    assert not (out_dir / "config.yaml").exists() or case in ("unknown_task", "learned_table_too_short")
    assert_untouched(out_dir)


def test_wrong_type_names_value_and_fix(out_dir, cache_dir, monkeypatch, capsys):
    code, text = train_cli(["model.d_model=abc"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "'abc'")
    assert_untouched(out_dir)


def test_failed_run_keeps_the_hydra_record_of_its_run_dir(out_dir, cache_dir, monkeypatch, capsys):
    """Hydra writes ``.hydra/`` before any check runs; a refused run puts the earlier record back."""
    record = out_dir / ".hydra"
    record.mkdir()
    names = ("overrides.yaml", "config.yaml")
    earlier = {name: f"# the earlier run's {name}\n- pe=rope\n".encode() for name in names}
    for name, data in earlier.items():
        (record / name).write_bytes(data)
    code, text = train_cli(["data.batch_size=0"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "data.batch_size=0")
    assert_untouched(out_dir)
    assert {p.name: p.read_bytes() for p in record.glob("*.yaml")} == earlier  # hydra.yaml not left either


def test_too_few_validation_batches_for_the_ddp_processes(out_dir, cache_dir, monkeypatch, capsys):
    """Two DDP processes, one validation batch: refused before any process is spawned."""
    code, text = train_cli(["trainer=ddp"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "1 batch(es)", "2 data-parallel processes", "data.n_val")
    assert_untouched(out_dir)


def test_failed_run_into_a_new_run_dir_leaves_nothing(tmp_path, cache_dir, monkeypatch, capsys):
    run = tmp_path / "fresh_run"
    code, text = train_cli(["data.batch_size=0"], run, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "data.batch_size=0")
    assert not run.exists()


# ------------------------------------------------------------------------------------------ data files
def test_missing_data_file(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    args = ["data=text", f"data.path={tmp_path}/nope.txt"]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=TEXT_TINY)
    assert_clean_failure(code, text, "nope.txt", "file not found")
    assert_untouched(out_dir)


def test_empty_data_file(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    args = ["data=text", f"data.path={tmp_path}/empty.txt"]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=TEXT_TINY)
    assert_clean_failure(code, text, "empty.txt", "empty (0 bytes)")
    assert_untouched(out_dir)


def test_text_not_utf8_reports_byte_offset(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    good = "To be, or not to be: that is the question.\n" * 20
    raw = good.encode() + b"caf\xe9 latin-1 here\n" + good.encode()
    offset = len(good.encode()) + 3
    (tmp_path / "latin1.txt").write_bytes(raw)
    args = ["data=text", f"data.path={tmp_path}/latin1.txt"]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=TEXT_TINY)
    assert_clean_failure(code, text, "latin1.txt", str(offset), "utf-8")
    assert_untouched(out_dir)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_utf16_or_utf32_file_is_named_with_its_encoding(
    encoding, out_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    """A UTF-16 file was called "not valid UTF-8" without naming UTF-16; with or without a
    byte-order mark, the line names the encoding and the iconv command that converts it."""
    text = "To be, or not to be: that is the question.\n" * 20
    (tmp_path / "wide.txt").write_bytes(text.encode(encoding))
    args = ["data=text", f"data.path={tmp_path}/wide.txt"]
    code, out = train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=TEXT_TINY)
    name = encoding.upper().replace("UTF-16", "UTF-16-LE") if encoding in ("utf-16",) else encoding.upper()
    name = "UTF-32-LE" if encoding == "utf-32" else name
    assert_clean_failure(code, out, "wide.txt", f"it is {name} text", f"iconv -f {name} -t UTF-8")
    assert_untouched(out_dir)


def _translation_cli(corpus: Path, out_dir: Path, cache_dir: Path, monkeypatch, capsys) -> tuple[int, str]:
    args = [
        *[a for a in TINY if not a.startswith(("data.", "model.n_layers"))],
        "data=translation",
        f"data.path={corpus}",
        "model=encdec_tiny",
        "model.n_encoder_layers=1",
        "model.n_decoder_layers=1",
        "pe=sinusoidal",
        "data.splits={train: train, val: val, test: test}",
        "data.vocab_size=300",
    ]
    return train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=[])


def _write_corpus(corpus: Path, n_src: int = 2, n_tgt: int = 2, bad: bytes = b"") -> None:
    corpus.mkdir(exist_ok=True)
    for split, ns, nt in (("train", n_src, n_tgt), ("val", 2, 2), ("test", 2, 2)):
        (corpus / f"{split}.de").write_bytes("".join(f"ein satz {i}\n" for i in range(ns)).encode() + bad)
        with gzip.open(corpus / f"{split}.en.gz", "wt") as f:
            f.write("".join(f"a sentence {i}\n" for i in range(nt)))


def test_parallel_corpus_line_counts_differ(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    _write_corpus(tmp_path / "corpus", n_src=5, n_tgt=4)
    code, text = _translation_cli(tmp_path / "corpus", out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "not aligned", "train.de' has 5 lines", "has 4")
    assert_untouched(out_dir)


def test_parallel_corpus_not_utf8_reports_byte_offset(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    _write_corpus(tmp_path / "corpus", bad=b"caf\xe9\n")  # latin-1 after two good lines
    code, text = _translation_cli(tmp_path / "corpus", out_dir, cache_dir, monkeypatch, capsys)
    offset = len(b"ein satz 0\nein satz 1\n") + 3
    assert_clean_failure(code, text, "train.de", "not valid UTF-8", f"offset {offset}", "iconv")
    assert_untouched(out_dir)


# ------------------------------------------------------------------------------------------ environment
def test_output_dir_not_writable_checked_before_training(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    target = blocker / "run"
    code, text = train_cli([f"paths.output_dir={target}"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, str(target), "not writable", "hydra.run.dir=")
    assert "parameters=" not in text  # failed before the model was built
    assert blocker.read_text() == "not a directory\n"
    assert_untouched(out_dir)


@pytest.mark.parametrize("entry", ["posformer.cli.train", "posformer.cli.evaluate"])
def test_hydra_run_dir_not_creatable(entry, out_dir, tmp_path, monkeypatch, capsys):
    """hydra.run.dir under a file: reported before Hydra starts (Hydra would print a traceback)."""
    import importlib

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    main = importlib.import_module(entry).main
    code, text = call(main, ["x", f"hydra.run.dir={blocker}/run", "trainer.max_steps=1"], monkeypatch, capsys)
    assert_clean_failure(
        code, text, "hydra.run.dir=", "a_file is a file, not a directory", "choose a writable"
    )
    assert blocker.read_text() == "not a directory\n"
    assert_untouched(out_dir)


class PoisonWeights(Callback):
    """Test-only hook: from step ``at`` on, the weights hold a NaN (as after a diverged update)."""

    def __init__(self, at: int = 4):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(out_dir, cache_dir, monkeypatch, capsys):
    args = [
        "trainer.max_steps=8",
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "+callbacks.poison._target_=tests.cli.test_bad_input.PoisonWeights",
        "+callbacks.poison.at=4",
    ]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, "training loss became nan at step 4", "Last good checkpoint", "lower optim.lr"
    )
    assert (out_dir / "results.json").read_bytes() == SENTINEL_RESULTS
    from posformer.checkpoints import safe_load_checkpoint

    good = sorted((out_dir / "checkpoints").glob("epoch=*step=4*.ckpt")) or sorted(
        (out_dir / "checkpoints").glob("*step*4*.ckpt")
    )
    assert good, sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    ckpt = safe_load_checkpoint(good[-1])
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    # nothing was saved after the bad step
    steps = [safe_load_checkpoint(p)["global_step"] for p in (out_dir / "checkpoints").glob("*step*.ckpt")]
    assert max(steps) == 4


def test_oom_at_long_length_keeps_results_so_far(trained, out_dir, monkeypatch, capsys):
    """A model that runs out of memory above length 8: the sweep stops with the length reached and
    keeps the rows done; a re-run with more memory continues from the failed length."""
    import posformer.eval.harness as ex

    real = ex.task_batch_sums

    def limited(model, batch, positions=None):
        width = max(batch[k].shape[1] for k in ("input_ids", "src_ids") if k in batch)
        if width > 14:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, batch, positions)

    monkeypatch.setattr(ex, "task_batch_sums", limited)
    ckpt = trained / "checkpoints" / "last.ckpt"
    args = [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[2,4,8,16]"]
    code, text = eval_cli(args, out_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, "out of memory", "at length 8", "longest length done is 4", "eval.batch_tokens"
    )
    rows = json.loads((out_dir / "extrapolation.json").read_text())["results"]
    status = {r["length"]: r["status"] for r in rows}
    assert status == {2: "ok", 4: "ok", 8: "oom"}
    assert_untouched(out_dir)
    monkeypatch.setattr(ex, "task_batch_sums", real)  # "more memory": the re-run resumes at length 8
    code, text = eval_cli(args, out_dir, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    data = json.loads((out_dir / "extrapolation.json").read_text())
    assert {r["length"]: r["status"] for r in data["results"]} == {2: "ok", 4: "ok", 8: "ok", 16: "ok"}
    assert data["meta"]["skipped_pairs"] == 2


# ------------------------------------------------------------------------------------------ subprocesses
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("module", "args", "needle"),
    [
        ("posformer.cli.train", ["trainer.precision=17-mixed"], "trainer.precision='17-mixed' is unknown"),
        ("posformer.cli.evaluate", ["eval.checkpoints=[/nonexistent/x.ckpt]"], "does not exist"),
    ],
)
@pytest.mark.slow  # subprocesses
def test_subprocess_exit_code_and_no_traceback(module, args, needle, out_dir):
    before = {p: _digest(p) for p in out_dir.rglob("*") if p.is_file()}
    proc = subprocess.run(
        [sys.executable, "-m", module, f"hydra.run.dir={out_dir}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out_dir.parent,
        env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
    )
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert {p: _digest(p) for p in before} == before

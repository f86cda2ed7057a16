"""Resources and numerics through the real mains (in-process, ``sys.argv`` patched): a checkpoint or
config declaring an absurd model is refused before a tensor is allocated; out of memory names the part
that is too large (the model's state or the batch's activations, with the estimate of each); RoPE scaling
numbers that overflow are refused at config time; ``posformer-bench --quick`` keeps the sizes given with
it; a full disk under TensorBoard while evaluating is one line; the printed resume command of a run dir
named with non-ASCII letters, spaces and quotes is read back by Hydra's override parser.
docs/reliability.md ("Own data, resources and numerics") lists each case with its before and after.
"""

from __future__ import annotations

import errno
import importlib
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_cases import TINY_RUN, assert_untouched, call, one_clear_line, train_cli

ABSURD = {"n_layers": 1_000_000, "d_model": 1024, "n_heads": 4, "d_ff": 4096}


def edit_checkpoint(path: Path, edit) -> None:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, path)


@pytest.fixture
def copied(tiny_run_dir, tmp_path) -> Path:
    """A copy of the session's tiny rope run (4 steps)."""
    run = tmp_path / "earlier"
    shutil.copytree(tiny_run_dir, run)
    return run


def evaluate(args: list[str], out: Path, monkeypatch, capsys, tensorboard: bool = False) -> tuple[int, str]:
    from posformer.cli.evaluate import main

    argv = ["posformer-eval", f"hydra.run.dir={out}", f"eval.output_dir={out}", "eval.progress=false"]
    return call(main, [*argv, f"eval.tensorboard={str(tensorboard).lower()}", *args], monkeypatch, capsys)


# ------------------------------------------------------------------------------------------ absurd sizes
def test_a_checkpoint_declaring_an_absurd_model_is_refused_before_building(
    copied, tmp_path, monkeypatch, capsys
):
    """main: posformer-eval built the million-layer model, allocating until the kernel killed it."""
    ckpt = copied / "checkpoints" / "last.ckpt"
    edit_checkpoint(ckpt, lambda c: c["hyper_parameters"]["model"].update(ABSURD))
    code, text = evaluate(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], tmp_path / "eval", monkeypatch, capsys
    )
    line = one_clear_line(code, text, 2, f"checkpoint '{ckpt}' declares a model of ~1.3e+13 parameters")
    assert "more than the" in line and "model.n_layers=1000000" in line and "crafted" in line, line
    assert not (tmp_path / "eval" / "extrapolation.json").exists()


def test_a_config_declaring_an_absurd_model_is_refused_before_building(
    out_dir, cache_dir, monkeypatch, capsys
):
    args = [f"model.{k}={v}" for k, v in ABSURD.items()]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "the model config declares a model of", "TiB of float32 weights")
    assert "largest part is set by model.n_layers=1000000" in line, line
    assert_untouched(out_dir)


def test_out_of_memory_of_a_model_larger_than_its_batch_names_the_model(
    tmp_path, cache_dir, monkeypatch, capsys
):
    """main: "lower data.batch_size=1 (e.g. data.batch_size=1 ...)", which cannot help when the model's
    weights, gradients and Adam's moments are what fills the memory."""
    big = ["model.d_model=64", "model.n_heads=2", "model.d_ff=256", "model.n_layers=2", "data.batch_size=1"]
    oom = ["+callbacks.oom._target_=tests.lit.test_lifecycle.OOMAtStep", "+callbacks.oom.at=1"]
    code, text = train_cli([*big, *oom], tmp_path / "run", cache_dir, monkeypatch, capsys, tiny=TINY_RUN)
    line = one_clear_line(code, text, 1, "out of memory at training step 1", "the model's size is the cause")
    assert "model state ~" in line and "activations of a batch of 1x" in line, line
    assert "data.batch_size" not in line and "model.n_layers=2, model.d_model=64" in line, line


def test_out_of_memory_of_a_batch_larger_than_its_model_names_the_batch():
    """The other side: activations outweigh the state, so the batch is named (with both estimates)."""
    from posformer.model.config import ModelConfig
    from posformer.model.size import oom_cause

    cfg = ModelConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    model_is_the_cause, words = oom_cause(cfg, batch=256, length=512)
    assert (
        not model_is_the_cause and "activations of a batch of 256x512 ~" in words and "model state ~" in words
    )


# ------------------------------------------------------------------------------------------ RoPE scaling
@pytest.mark.parametrize(
    ("scaling", "needle"),
    [
        ("{type: yarn, factor: 1e308, original_max_len: 8}", "scaling.factor=1e+308 must be a number from 1"),
        ("{type: ntk, factor: 1e308}", "scaling.factor=1e+308"),
        ("{type: dynamic_ntk, factor: 1e308, original_max_len: 4}", "scaling.factor=1e+308"),
        ("{type: llama3, factor: 4, original_max_len: 8, low_freq_factor: 1e308}", "low_freq_factor=1e+308"),
        ("{type: llama3, factor: 4, original_max_len: 8, low_freq_factor: 4}", "must be below scaling.high"),
        ("{type: yarn, factor: 4, original_max_len: 8, attention_factor: 1e300}", "attention_factor=1e+300"),
    ],
    ids=[
        "yarn_factor",
        "ntk_factor",
        "dynamic_ntk_factor",
        "llama3_band_overflow",
        "llama3_empty_band",
        "attention",
    ],
)
def test_rope_scaling_that_overflows_is_refused_at_config_time(
    scaling, needle, out_dir, cache_dir, monkeypatch, capsys
):
    """main: yarn trained with a cos/sin factor of 72, ntk died with an OverflowError traceback,
    dynamic_ntk and llama3 trained on frequencies of inf or 0."""
    code, text = train_cli(
        ["pe=rope", f"model.pe_options.scaling={scaling}"], out_dir, cache_dir, monkeypatch, capsys
    )
    one_clear_line(code, text, 1, "pe='rope'", needle)
    assert_untouched(out_dir)


def test_an_infinite_scaling_factor_in_a_checkpoint_is_refused(copied, tmp_path, monkeypatch, capsys):
    """The config check refused inf already; a checkpoint's own options go through the PE's check."""
    ckpt = copied / "checkpoints" / "last.ckpt"
    scaling = {"type": "linear", "factor": float("inf")}
    edit_checkpoint(ckpt, lambda c: c["hyper_parameters"]["model"]["pe_options"].update(scaling=scaling))
    code, text = evaluate(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], tmp_path / "eval", monkeypatch, capsys
    )
    one_clear_line(code, text, 2, "scaling.factor=inf must be a number from 1 to 2**31")


# ------------------------------------------------------------------------------------------ bench --quick
def test_bench_quick_keeps_the_sizes_given_with_it(tmp_path, monkeypatch, capsys):
    """main: ``--quick --d-model 64 --n-layers 3 --eval-lengths 256`` benchmarked width 32, 2 layers and
    lengths 64, 128, without a word."""
    from posformer.cli.bench import main

    seen = []  # the module, not posformer.bench's function of the same name
    monkeypatch.setattr(
        importlib.import_module("posformer.bench.run"), "run", lambda cfg: seen.append(cfg) or {}
    )
    monkeypatch.setattr(
        importlib.import_module("posformer.bench.report"), "print_table", lambda results: None
    )
    given = ["--d-model", "64", "--n-layers", "3", "--eval-lengths", "256"]
    code, text = call(
        main, ["posformer-bench", "--quick", *given, "--out", str(tmp_path)], monkeypatch, capsys
    )
    assert code == 0, text
    (cfg,) = seen
    assert (cfg.d_model, cfg.n_layers, cfg.eval_lengths) == (64, 3, [256])  # as given
    assert (cfg.n_heads, cfg.seq_len, cfg.reps) == (2, 32, 2)  # the rest: --quick's
    seen.clear()
    call(main, ["posformer-bench", "--quick", "--out", str(tmp_path)], monkeypatch, capsys)
    assert (seen[0].d_model, seen[0].n_layers, seen[0].eval_lengths) == (32, 2, [64, 128])


# ------------------------------------------------------------------------------------------ older cases
def test_a_full_disk_under_tensorboard_while_evaluating_is_one_line(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """TensorBoard's event writer hits ENOSPC (its thread's error comes back on the next write or close):
    one line naming the folder and the fix (``eval.tensorboard=false``), exit 2, the results kept."""
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    out = tmp_path / "eval"
    args = [f"eval.checkpoints=[{tiny_checkpoint}]", "eval.lengths=[4]"]
    code, text = evaluate(args, out, monkeypatch, capsys, tensorboard=True)
    line = one_clear_line(code, text, 2, "No space left on device", "tensorboard")
    assert "eval.tensorboard=false" in line, line
    assert (out / "extrapolation.json").is_file()  # the rows were saved before the plots


@pytest.mark.slow
def test_the_printed_resume_command_of_an_oddly_named_run_dir_parses(
    tmp_path, cache_dir, monkeypatch, capsys
):
    """main: ``'hydra.run.dir=…/rün 'x''`` shell-quoted only: Hydra refused the pasted command
    ("token recognition error at: 'ü'")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from posformer.lit.lifecycle import hydra_value

    run = tmp_path / "rün dir 'x', [1]"
    sig = ["+callbacks.sig._target_=tests.lit.test_lifecycle.SendSignal", "+callbacks.sig.at=2"]
    argv = [*TINY_RUN, f"hydra.run.dir={hydra_value(str(run))}", f"paths.root_dir={tmp_path}"]
    from posformer.cli.train import main

    code, text = call(
        main, ["posformer-train", *argv, f"paths.cache_dir={cache_dir}", *sig], monkeypatch, capsys
    )
    line = one_clear_line(code, text, 143, "interrupted by SIGTERM", "resume with:")
    command = shlex.split(line.split("resume with: ", 1)[1])  # as a shell reads it
    parser = OverridesParser.create()
    values = {o.key_or_group: o.value() for o in parser.parse_overrides(command[1:])}
    assert values["hydra.run.dir"] == str(run)
    assert values["ckpt_path"] == str(run / "checkpoints" / "last.ckpt")
    resumed = [a for a in command[1:] if not a.startswith("+callbacks.sig")]
    code, text = call(main, ["posformer-train", *resumed], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert (run / "results.json").is_file()

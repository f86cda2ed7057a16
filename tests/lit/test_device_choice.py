"""A GPU is used when there is one: the default trainer is ``auto``.

- :func:`posformer.devices.resolve_device` maps ``(accelerator, precision)`` to concrete values:
  CUDA + native bf16 -> ``cuda``/``bf16-mixed``, an older CUDA GPU -> ``16-mixed``, no CUDA ->
  ``cpu``/``32-true``; explicit values pass through; ``gpu`` without CUDA is one ConfigError line.
  The CUDA branches run here on the CPU with ``torch.cuda`` monkeypatched.
- ``configs/train.yaml`` and ``configs/eval.yaml`` compose with ``trainer=auto``; ``trainer=cpu`` and
  ``trainer=gpu`` stay as they were.
- The training model line and posformer-eval's first line name the device and precision; results
  record the resolved values while the run's ``config.yaml`` keeps ``auto``.
- Piped ``posformer-eval`` (stdout not a terminal) prints one line per finished row, before the tables.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from hydra import compose, initialize_config_module

from posformer.configs.settings import read_train
from posformer.devices import Device, describe_device, resolve_device
from posformer.errors import ConfigError
from tests.cli_cases import TINY_RUN, call, eval_cli

GPU_NAME = "NVIDIA H200"


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *, available: bool, native_bf16: bool = True) -> None:
    """``torch.cuda`` as on a machine with (``available``) a GPU with or without bf16 in hardware.

    An older GPU reports bf16 only with emulation (``including_emulation=True``, torch's default)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: available and (native_bf16 or including_emulation),
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU_NAME)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if available else 0)


def compose_config(name: str, overrides: list[str] | None = None, **kwargs):
    with initialize_config_module("posformer.configs", version_base="1.3"):
        return compose(
            name, overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *(overrides or [])], **kwargs
        )


# ------------------------------------------------------------------------------------------ the resolver
@pytest.mark.parametrize(
    ("available", "native_bf16", "asked", "used"),
    [
        # no CUDA: the CPU in full precision
        (False, False, ("auto", "auto"), ("cpu", "32-true")),
        (False, False, ("cpu", "auto"), ("cpu", "32-true")),
        # a GPU with bf16 in hardware (Ampere and newer)
        (True, True, ("auto", "auto"), ("cuda", "bf16-mixed")),
        (True, True, ("gpu", "auto"), ("gpu", "bf16-mixed")),
        (True, True, ("cpu", "auto"), ("cpu", "32-true")),  # trainer=cpu on a GPU machine: the CPU
        # an older GPU: bf16 only emulated -> fp16 mixed precision
        (True, False, ("auto", "auto"), ("cuda", "16-mixed")),
        # explicit values pass through unchanged
        (True, True, ("auto", "32-true"), ("cuda", "32-true")),
        (True, False, ("gpu", "bf16-mixed"), ("gpu", "bf16-mixed")),
        (False, False, ("cpu", "bf16-mixed"), ("cpu", "bf16-mixed")),
        (False, False, ("auto", "16-true"), ("cpu", "16-true")),
    ],
)
def test_resolver_picks_device_and_precision(monkeypatch, available, native_bf16, asked, used):
    fake_cuda(monkeypatch, available=available, native_bf16=native_bf16)
    assert resolve_device(*asked) == Device(*used)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_resolver_refuses_a_gpu_without_cuda(monkeypatch, accelerator):
    fake_cuda(monkeypatch, available=False)
    with pytest.raises(ConfigError) as err:
        resolve_device(accelerator, "auto")
    message = str(err.value)
    assert "\n" not in message
    assert f"trainer.accelerator={accelerator} but no CUDA device is available" in message
    assert "trainer=auto" in message and "trainer=cpu" in message


def test_device_description(monkeypatch):
    fake_cuda(monkeypatch, available=True)
    assert (
        describe_device(Device("cuda", "bf16-mixed")) == f"device cuda:0 ({GPU_NAME}), precision bf16-mixed"
    )
    assert (
        describe_device(Device("gpu", "16-mixed"), devices=[1])
        == f"device cuda:1 ({GPU_NAME}), precision 16-mixed"
    )
    assert describe_device(Device("gpu", "bf16-mixed"), devices=2).startswith(f"device 2 x cuda ({GPU_NAME})")
    assert describe_device(Device("cpu", "32-true")) == "device cpu, precision 32-true"
    assert describe_device(Device("cpu", "32-true"), devices=2) == "device 2 x cpu, precision 32-true"


# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ["train", "eval"])
def test_default_trainer_is_auto(monkeypatch, name):
    """train.yaml and eval.yaml pick trainer=auto; it validates and becomes cpu/32-true without CUDA,
    cuda/bf16-mixed on a bf16 GPU, through the same path the Trainer's arguments take."""
    from posformer.lit.trainer import trainer_kwargs

    assert compose_config(name, return_hydra_config=True).hydra.runtime.choices.trainer == "auto"
    cfg = compose_config(name)
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("auto", "auto")
    assert cfg.trainer.devices == 1  # the rest as in trainer=cpu
    if name == "train":
        assert cfg.trainer.max_steps == 2000 and cfg.trainer.gradient_clip_val == 1.0
        read_train(cfg)  # precision=auto is a valid value
    fake_cuda(monkeypatch, available=False)
    kw = trainer_kwargs(cfg)
    assert (kw["accelerator"], kw["precision"]) == ("cpu", "32-true")
    fake_cuda(monkeypatch, available=True)
    kw = trainer_kwargs(cfg)
    assert (kw["accelerator"], kw["precision"]) == ("cuda", "bf16-mixed")


def test_experiments_follow_the_default_and_explicit_trainers_are_unchanged():
    """``make run`` (experiment=ablation) and experiment=default take trainer=auto; trainer=cpu and
    trainer=gpu keep their values; one key can be set alone on top of auto."""
    choices = {
        "experiment=ablation": ("auto", "auto"),
        "experiment=default": ("auto", "auto"),
        "trainer=cpu": ("cpu", "32-true"),
        "trainer=gpu": ("gpu", "bf16-mixed"),
        "trainer.precision=16-mixed": ("auto", "16-mixed"),
    }
    for override, expected in choices.items():
        cfg = compose_config("train", [override])
        assert (cfg.trainer.accelerator, cfg.trainer.precision) == expected, override


def test_validation_names_auto_among_precisions():
    cfg = compose_config("train", ["trainer.precision=fp8"])
    with pytest.raises(ConfigError, match=r"trainer.precision='fp8' is unknown; valid: auto, 32-true"):
        read_train(cfg)


# ------------------------------------------------------------------------------------------ training
def test_model_line_names_device_and_precision(tmp_path, monkeypatch, caplog):
    """A tiny default-trainer run: the model line says ``attention auto -> sdpa`` (the backend on the CPU)
    and ``device cpu, precision 32-true``; results.json
    records the resolved values; config.yaml keeps ``auto`` (what was asked)."""
    from posformer.training import run

    fake_cuda(monkeypatch, available=False)  # the CPU branch, also on a machine with a GPU
    overrides = [
        *TINY_RUN,
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    cfg = compose_config("train", overrides)
    caplog.set_level(logging.INFO, logger="posformer.cli.train")
    results = run(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model: ")]
    assert len(lines) == 1, caplog.text
    assert re.fullmatch(
        r"model: decoder, pe=rope, d_model=16, [\d,]+ parameters, attention auto -> sdpa, seed 0, "
        r"device cpu, precision 32-true",
        lines[0],
    ), lines[0]
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    for res in (results, saved):
        assert (res["accelerator"], res["precision"], res["device"]) == ("cpu", "32-true", "cpu")
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "accelerator: auto" in config and "precision: auto" in config


# ------------------------------------------------------------------------------------------ posformer-eval
@pytest.mark.slow
def test_piped_eval_prints_one_line_per_row(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """stdout is not a terminal under capsys: a line per finished row, in order, before the tables;
    the first line names the device and precision; a re-run counts the rows it skips."""
    from posformer.cli.evaluate import main

    fake_cuda(monkeypatch, available=False)
    run = tmp_path / "eval"
    argv = [
        "posformer-eval",
        f"hydra.run.dir={run}",
        f"eval.output_dir={run}",
        "eval.tensorboard=false",
        "eval.progress=true",
        f"eval.checkpoints=[{tiny_checkpoint}]",
        "eval.lengths=[4,8]",
    ]
    code, text = call(main, argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "evaluating 1 series at 2 length(s) (4, 8), device cpu, precision 32-true" in text
    row = r"\[{i}/2\] \S.* length {n}: exact match \d\.\d{{3}} \(\d+ tokens, \d+\.\d s\)"
    first, second = (re.search(row.format(i=i, n=n), text) for i, n in ((1, 4), (2, 8)))
    assert first and second, text
    table = text.index("exact match by length")
    assert first.start() < second.start() < table
    assert "━" not in text[:table]  # no rich bar when piped
    meta = json.loads((run / "extrapolation.json").read_text())["meta"]
    assert (meta["accelerator"], meta["precision"], meta["device"]) == ("cpu", "32-true", "cpu")

    argv[-1] = "eval.lengths=[4,8,16]"  # the same output dir: 2 rows done earlier, 1 new
    code, text = call(main, argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert re.search(r"\[2/3\] \S.*: 2 row\(s\) already in extrapolation.json, skipped", text), text
    assert re.search(row.format(i=3, n=16).replace("/2", "/3"), text), text

    argv[1:3] = [f"hydra.run.dir={run}_quiet", f"eval.output_dir={run}_quiet"]
    argv[4] = "eval.progress=false"  # neither bar nor lines
    code, text = call(main, argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "[1/3]" not in text and "exact match by length" in text


def test_terminal_gets_the_bar_not_lines(capsys):
    from posformer.eval.console import EvalProgress

    row = {
        "series": "s",
        "mode": "task",
        "task_type": "task",
        "length": 4,
        "status": "ok",
        "exact_match": 0.5,
        "scored_tokens": 10,
        "seconds": 1.5,
    }
    with EvalProgress(True, 1, terminal=True) as progress:
        progress.row(row)
    assert "[1/1]" not in capsys.readouterr().out
    with EvalProgress(True, 1, terminal=False) as progress:
        progress.row(row)
    assert capsys.readouterr().out == "[1/1] s length 4: exact match 0.500 (10 tokens, 1.5 s)\n"


def test_eval_gpu_without_cuda_is_one_line_before_any_work(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    fake_cuda(monkeypatch, available=False)
    out = tmp_path / "e"
    code, text = eval_cli(
        ["trainer=gpu", f"eval.checkpoints=[{tiny_checkpoint}]", "eval.lengths=[4]"], out, monkeypatch, capsys
    )
    assert code == 2, text[-3000:]
    assert "Traceback" not in text
    assert "posformer-eval: error: trainer.accelerator=gpu but no CUDA device is available" in text
    assert not (out / "extrapolation.json").exists()


def test_row_line_of_language_model_and_skipped_rows():
    """LM rows name the scoring mode and the perplexity; a row that could not run says why."""
    from posformer.eval.console import row_line

    lm = {
        "series": "rope · seed 0",
        "mode": "nonoverlap",
        "task_type": "lm",
        "length": 256,
        "status": "ok",
        "ppl": 7.9512,
        "scored_tokens": 2048,
        "seconds": 1.21,
    }
    assert row_line(lm) == "rope · seed 0 nonoverlap length 256: ppl 7.95 (2048 tokens, 1.2 s)"
    na = {**lm, "status": "n/a", "reason": "needs 512 positions, the table has 256\nmore", "seconds": 0.0}
    assert (
        row_line(na)
        == "rope · seed 0 nonoverlap length 256: n/a (needs 512 positions, the table has 256) (0.0 s)"
    )


def test_bf16_on_the_cpu_warns_once_that_it_is_usually_slower(tmp_path, caplog):
    """``trainer.precision=bf16-mixed`` with the CPU: one warning before training; the GPU and fp32 none."""
    from posformer.devices import cpu_bf16_note
    from posformer.training import run

    assert cpu_bf16_note(Device("cuda", "bf16-mixed")) == cpu_bf16_note(Device("cpu", "32-true")) == ""
    overrides = [
        *TINY_RUN,
        "trainer.accelerator=cpu",
        "trainer.precision=bf16-mixed",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    caplog.set_level(logging.INFO, logger="posformer.cli.train")
    run(compose_config("train", overrides))
    warned = [r for r in caplog.records if "slower than fp32 on CPUs" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.text
    assert "trainer.precision=bf16-mixed on the CPU" in warned[0].getMessage()

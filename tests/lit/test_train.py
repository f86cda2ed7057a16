"""posformer-train end to end: smoke runs for every PE and both models, learning, exact resume,
fast_dev_run, multirun, DDP on two CPU processes and clean error output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from posformer.errors import ConfigError, DataError, PosformerError
from posformer.lit import LanguageModelModule, Seq2SeqModule
from posformer.training import run

PES = ["sinusoidal", "learned", "rope", "xpos", "alibi", "t5", "shaw", "fire", "kerple", "nope"]
TINY_DATA = [
    "data.n_train=96",
    "data.n_val=32",
    "data.n_eval_per_length=16",
    "data.batch_size=16",
    "data.train_len=[1,4]",
    "data.eval_lengths=[4,8]",
]
TINY_MODEL = {
    "decoder": [
        "model=decoder_tiny",
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_layers=1",
        "model.d_ff=32",
    ],
    "encoder_decoder": [
        "model=encdec_tiny",
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_encoder_layers=1",
        "model.n_decoder_layers=1",
        "model.d_ff=32",
    ],
}
QUIET = [
    "logger=none",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
    "callbacks.pe_heatmap=null",
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is as fast and does not fight other processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


def make_cfg(tmp: Path, cache: Path, overrides: list[str]):
    base = [f"paths.root_dir={tmp}", f"paths.output_dir={tmp}/run", f"paths.cache_dir={cache}"]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        return compose("train", overrides=base + overrides)


def steps(n: int) -> list[str]:
    return [
        f"trainer.max_steps={n}",
        f"trainer.val_check_interval={n}",
        "trainer.log_every_n_steps=1",
        "schedule.warmup_steps=1",
    ]


@pytest.mark.parametrize(
    ("pe", "kind"),
    [  # a training run each: rope's decoder and t5's encoder-decoder stay fast; these PEs also train in
        # the fast set in test_reliability (every precision) and test_device_guard (one step)
        pytest.param(
            pe,
            kind,
            marks=() if (pe, kind) in {("rope", "decoder"), ("t5", "encoder_decoder")} else pytest.mark.slow,
        )
        for pe in PES
        for kind in ("decoder", "encoder_decoder")
    ],
)
def test_smoke_every_pe_both_models(pe, kind, tmp_path, cache_dir):
    cfg = make_cfg(tmp_path, cache_dir, [f"pe={pe}", *TINY_MODEL[kind], *TINY_DATA, *steps(3), *QUIET])
    res = run(cfg)
    assert res["global_step"] == 3 and res["val"]["val/loss"] > 0  # validation ran; kept past evaluation
    lengths = [r["length"] for r in res["results"]]
    assert lengths == [4, 8]
    for r in res["results"]:
        assert r["n_sequences"] == 16 and 0.0 <= r["token_acc"] <= 1.0 and r["loss"] > 0
    out = Path(cfg.paths.output_dir)
    for name in ("results.json", "results.csv", "results.md", "config.yaml"):
        assert (out / name).is_file()
    ckpt = res["checkpoint"]["last"]
    cls = LanguageModelModule if kind == "decoder" else Seq2SeqModule
    module = cls.load_from_checkpoint(ckpt, map_location="cpu")  # no Hydra needed
    assert module.model_config.pe == pe


@pytest.mark.slow  # a 250-step training run (5-8 s)
def test_default_task_is_learned(tmp_path, cache_dir):
    """A short version of the default task (reverse, RoPE, decoder_tiny, default optimiser and
    schedule) reaches >= 0.99 exact match at every training length."""
    cfg = make_cfg(
        tmp_path,
        cache_dir,
        [
            "data.train_len=[1,4]",
            "data.symbols=3",
            "data.n_train=2000",
            "data.n_eval_per_length=64",
            "data.eval_lengths=[1,2,3,4]",
            "data.batch_size=32",
            "schedule.warmup_steps=30",
            "trainer.max_steps=250",
            "trainer.val_check_interval=250",
            *QUIET,
        ],
    )
    res = run(cfg)
    assert [r["length"] for r in res["results"]] == [1, 2, 3, 4]
    for row in res["results"]:
        assert row["in_distribution"] and row["exact_match"] >= 0.99, row


def test_resume_is_exact(tmp_path, cache_dir):
    """12 steps in one go == 6 steps + resume + 6 steps (dropout and randomized positions on, so the
    RNG, the data position (mid-epoch and across an epoch), optimiser and schedule must all resume)."""
    common = [
        *TINY_MODEL["decoder"],
        *TINY_DATA,
        "data.n_train=128",
        "model.dropout=0.1",
        "positions.randomized=true",
        "positions.n_max=64",
        "schedule.total_steps=12",
        "schedule.warmup_steps=3",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=1",
        "callbacks.model_checkpoint.monitor=null",
        "evaluate=false",
        *QUIET,
    ]  # 128 / 16 = 8 batches per epoch: step 6 is mid-epoch, step 12 in the second epoch
    full = run(make_cfg(tmp_path / "full", cache_dir, [*common, "trainer.max_steps=12"]))
    half = run(make_cfg(tmp_path / "half", cache_dir, [*common, "trainer.max_steps=6"]))
    ckpt = Path(half["checkpoint"]["last"])
    resumed = run(
        make_cfg(tmp_path / "resumed", cache_dir, [*common, "trainer.max_steps=12", f"ckpt_path={ckpt}"])
    )
    assert full["global_step"] == resumed["global_step"] == 12
    assert full["train"]["train/loss"] == pytest.approx(resumed["train"]["train/loss"], abs=1e-6)
    assert full["val"]["val/loss"] == pytest.approx(resumed["val"]["val/loss"], abs=1e-6)
    a = torch.load(full["checkpoint"]["last"], map_location="cpu", weights_only=False)["state_dict"]
    b = torch.load(resumed["checkpoint"]["last"], map_location="cpu", weights_only=False)["state_dict"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_fast_dev_run_and_bad_values(tmp_path, cache_dir):
    res = run(make_cfg(tmp_path, cache_dir, ["debug=fdr", *TINY_MODEL["decoder"], *TINY_DATA, *QUIET]))
    assert res["global_step"] == 1 and res["results"]
    with pytest.raises(ConfigError, match=r"data.batch_size=-4"):
        run(make_cfg(tmp_path, cache_dir, ["data.batch_size=-4"]))
    with pytest.raises(ConfigError, match=r"trainer.precision='17-mixed' is unknown"):
        run(make_cfg(tmp_path, cache_dir, ["trainer.precision=17-mixed"]))
    with pytest.raises(PosformerError, match=r"train_len"):
        run(make_cfg(tmp_path, cache_dir, ["data.train_len=[-2,4]", *QUIET]))
    with pytest.raises(ConfigError, match=r"positions.n_max=8 is smaller than the longest training sequence"):
        run(
            make_cfg(
                tmp_path, cache_dir, [*TINY_DATA, "positions.randomized=true", "positions.n_max=8", *QUIET]
            )
        )
    with pytest.raises(ConfigError, match=r"represents 6 positions"):
        run(make_cfg(tmp_path, cache_dir, [*TINY_DATA, "pe=learned", "model.pe_options.max_len=6", *QUIET]))


def test_missing_and_empty_data_files(tmp_path, cache_dir):
    with pytest.raises(DataError, match=r"file not found"):
        run(make_cfg(tmp_path, cache_dir, ["data=text", f"data.path={tmp_path}/nope.txt", *QUIET]))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"is empty \(0 bytes\)"):
        run(make_cfg(tmp_path, cache_dir, ["data=text", f"data.path={tmp_path}/empty.txt", *QUIET]))


def _cli(
    args: list[str], cwd: Path, timeout: int = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow  # subprocesses
def test_cli_errors_are_clean(tmp_path):
    proc = _cli(["pe=rotary", f"paths.log_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 1
    assert "Could not find 'pe/rotary'" in proc.stderr and "rope" in proc.stderr  # lists valid options
    proc = _cli(["model.d_model=30", "model.n_heads=4", f"paths.log_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 1
    assert "error: model.d_model=30 is not divisible by model.n_heads=4" in proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


@pytest.mark.slow  # DDP, subprocesses
def test_ddp_two_cpu_processes(tmp_path, cache_dir):
    args = [
        "trainer=ddp",
        f"paths.log_dir={tmp_path}",
        f"paths.cache_dir={cache_dir}",
        *TINY_DATA,
        *TINY_MODEL["decoder"],
        *steps(4),
        "logger=none",
        "callbacks.pe_heatmap=null",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
    ]
    proc = _cli(args, tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [res_path] = list((tmp_path / "train" / "runs").glob("*/results.json"))
    res = json.loads(res_path.read_text())
    assert res["global_step"] == 4 and res["world_size"] == 2
    # exact evaluation: every sequence counted once although two ranks shared the batches
    assert [r["n_sequences"] for r in res["results"]] == [16, 16]


@pytest.mark.slow  # torch.compile of a training run (9-16 s); fast: test_models' compile case
def test_compile_switch_trains_and_checkpoints_load_without_it(tmp_path, cache_dir):
    """compile.enabled=true: the run trains and evaluates; its checkpoint loads into a plain module."""
    cfg = make_cfg(
        tmp_path,
        cache_dir,
        ["pe=rope", *TINY_MODEL["encoder_decoder"], *TINY_DATA, *steps(2), *QUIET]
        + ["compile.enabled=true", "compile.backend=aot_eager"],
    )
    res = run(cfg)
    assert res["global_step"] == 2 and [r["length"] for r in res["results"]] == [4, 8]
    module = Seq2SeqModule.load_from_checkpoint(res["checkpoint"]["last"], map_location="cpu", compile=None)
    assert module.compile_cfg is None and module.model_config.pe == "rope"


def test_float32_matmul_precision_is_set_per_run(tmp_path, cache_dir):
    """float32_matmul_precision=high: torch's setting for the run (TF32 on GPUs); the next run with the
    default (null) sets highest again (a multirun's jobs share the process)."""
    from posformer.configs.settings import read_train
    from posformer.training import setup_process

    try:
        setup_process(read_train(make_cfg(tmp_path, cache_dir, ["float32_matmul_precision=high"])))
        assert torch.get_float32_matmul_precision() == "high"
        setup_process(read_train(make_cfg(tmp_path, cache_dir, [])))
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision("highest")


def test_bad_compile_settings_are_one_config_error(tmp_path, cache_dir):
    bad = ["compile.enabled=true", "compile.backend=nonsense", "compile.mode=fast"]
    cfg = make_cfg(tmp_path, cache_dir, bad)
    with pytest.raises(ConfigError) as err:
        run(cfg)
    msg = str(err.value)
    assert "compile.backend='nonsense'" in msg and "inductor" in msg and "compile.mode='fast'" in msg


def test_out_of_memory_in_the_final_evaluation_keeps_the_other_lengths(tmp_path, cache_dir, monkeypatch):
    """An OOM at one evaluation length: the run finishes, that row says why, the others are reported."""
    original = LanguageModelModule.test_step

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        if self.test_lengths[dataloader_idx] == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test)")
        return original(self, batch, batch_idx, dataloader_idx)

    monkeypatch.setattr(LanguageModelModule, "test_step", test_step)
    cfg = make_cfg(tmp_path, cache_dir, ["pe=alibi", *TINY_MODEL["decoder"], *TINY_DATA, *steps(2), *QUIET])
    res = run(cfg)
    by_length = {r["length"]: r for r in res["results"]}
    assert by_length[4]["n_sequences"] == 16 and by_length[4]["loss"] > 0
    assert by_length[8]["n_sequences"] == 0 and "out of memory" in by_length[8]["note"]
    saved = json.loads((Path(cfg.paths.output_dir) / "results.json").read_text())
    assert "out of memory" in json.dumps(saved)

"""No host sync in a training step: the CPU suite finds the reads a GPU step would wait on.

On a GPU, reading a device value on the host (``bool(t)``, ``.item()``, ``float(t)``, ``.tolist()``,
``.cpu()``) waits for every queued kernel, and so does ``torch.tensor(x, device=...)`` (a blocking
copy of host data): the GPU then idles while Python prepares the next step. On the CPU both cost
nothing and go unnoticed. :class:`HostReads` (a ``TorchFunctionMode``) records every such call made
while a training batch runs (the module's ``on_train_batch_start`` to its ``on_train_batch_end``:
forward, loss, backward, every callback hook, the optimiser step) in real ``posformer-train`` runs
with the default callbacks and the rich progress bar.

The reads a run is designed to make are placed outside those steps here: the logger and the NaN
guard read at log steps (``trainer.log_every_n_steps`` beyond the run), the bar reads its metrics at
most every ``metrics_every_s`` and at the last step (the positive control: the recorder sees it).
Fused AdamW, the CUDA default, is taken on the CPU too (``optim.fused=true``), so the step is the one
a GPU runs.

The ``cuda`` twin runs the same flow on a GPU under ``torch.cuda.set_sync_debug_mode("error")``.
The NaN guard's two ways (the fused optimiser's in-kernel skip, the host read) are checked below.
"""

from __future__ import annotations

import inspect
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode

import posformer
from posformer.lit.callbacks import NonFiniteLossGuard, TrainingDivergedError, skips_on_device
from posformer.lit.modules import PosformerModule, without_full_masks
from posformer.pe import ENCODINGS
from tests.cli_cases import TINY_DATA, TINY_MODEL, assert_clean_failure, train_cli

#: tensor methods that read a value on the host (on a GPU: wait for the queued kernels)
HOST_READS = frozenset(
    {"__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__"}  # Python values, printing
    | {"item", "tolist", "numpy", "cpu"}  # copies to the host
    | {"nonzero", "masked_select", "unique"}  # results sized by the data
)
#: factories that copy host data to the device they are given (a blocking copy on a GPU)
HOST_COPIES = frozenset({"tensor", "as_tensor", "scalar_tensor"})
STEPS = 6


def _where() -> str:
    """The innermost posformer / Lightning frames of the current stack, as ``file:line``."""
    frames = [
        f for f in traceback.extract_stack()[:-2] if "posformer" in f.filename or "lightning" in f.filename
    ]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))


class HostReads(TorchFunctionMode):
    """Records ``(step, call, where)`` of every host read made while ``step`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None
        self.found: list[tuple[int, str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.step is not None:
            name = getattr(func, "__name__", "")
            if name in HOST_READS or (name in HOST_COPIES and kwargs.get("device") is not None):
                self.found.append((self.step, name, _where()))
        return func(*args, **kwargs)


def watch_training_steps(monkeypatch: pytest.MonkeyPatch, start: Any, stop: Any) -> None:
    """``start(step)`` when a training batch begins (after the module's own hook), ``stop(step)`` when
    it ends (after every callback's and the module's ``on_train_batch_end``)."""
    begin, end = PosformerModule.on_train_batch_start, PosformerModule.on_train_batch_end

    def on_start(self: PosformerModule, batch: Any, batch_idx: int) -> None:
        begin(self, batch, batch_idx)
        start(int(self.trainer.global_step))

    def on_end(self: PosformerModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        end(self, outputs, batch, batch_idx)
        stop(int(self.trainer.global_step) - 1)

    monkeypatch.setattr(PosformerModule, "on_train_batch_start", on_start)
    monkeypatch.setattr(PosformerModule, "on_train_batch_end", on_end)


CASES = {
    "task-padded-rope": [*TINY_DATA, *TINY_MODEL, "pe=rope"],
    "task-packed-alibi": [*TINY_DATA, *TINY_MODEL, "pe=alibi", "data.pack=true"],
    "corpus-packed-t5": [
        *TINY_MODEL,
        "pe=t5",
        "data=corpus",
        "data.n_chars=20000",
        "data.block_size=16",
        "data.batch_size=4",
        "data.eval_lengths=[16]",
        "data.eval_tokens=64",
        "data.pack=true",
    ],
    "translation-padded-t5": [
        *TINY_DATA,
        "model=encdec_tiny",
        "model.d_model=16",
        "model.n_heads=2",
        "pe=t5",
    ],
    "translation-padded-shaw": [  # the regions of Shaw's shortcut, bidirectional, on padded rows
        *TINY_DATA,
        "model=encdec_tiny",
        "model.d_model=16",
        "model.n_heads=2",
        "pe=shaw",
        "model.pe_options.shortcut_min_len=0",
        "model.pe_options.max_relative_position=2",
    ],
}
FLOW = [
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.log_every_n_steps=100",  # the logger's and the NaN guard's reads: beyond the run
    "schedule.warmup_steps=1",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar.metrics_every_s=1e9",  # the bar's metrics: at the last step only
    "optim.fused=true",  # the CUDA optimiser, on the CPU too
]


def _flow_args(case: str, run_dir: Path, trainer: str) -> list[str]:
    # on a GPU heads of 16 (d_model 32, 2 heads): the least FlexAttention's GPU kernel takes, so the
    # bias PEs' steps run in Flex there, as a real model's do (heads of 8 keep to SDPA on CUDA)
    gpu = ["model.d_model=32"] if trainer == "gpu" else []
    return [
        *CASES[case],
        *FLOW,
        *gpu,
        f"trainer={trainer}",
        f"paths.root_dir={run_dir.parent}",
        f"paths.output_dir={run_dir}",
        f"paths.cache_dir={run_dir.parent}/cache",
    ]


def _run_flow(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra import compose, initialize_config_module

    from posformer.cli.train import run

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # the rich bar, as in a terminal
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=args)
    run(cfg)


@pytest.mark.parametrize(
    "case",
    [
        "task-padded-rope",
        pytest.param("task-packed-alibi", marks=pytest.mark.slow),
        pytest.param("corpus-packed-t5", marks=pytest.mark.slow),
        pytest.param("translation-padded-t5", marks=pytest.mark.slow),
        pytest.param("translation-padded-shaw", marks=pytest.mark.slow),
    ],
)
def test_training_steps_read_nothing_on_the_host(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_steps_read_nothing(_flow_args(case, tmp_path / "run", "cpu"), tmp_path / "run", monkeypatch)


def assert_steps_read_nothing(args: list[str], run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the flow ``args`` into ``run`` under :class:`HostReads`: no read before the last step, the
    bar's read at the last step (the positive control)."""
    recorder = HostReads()
    watch_training_steps(
        monkeypatch,
        lambda step: setattr(recorder, "step", step),
        lambda step: setattr(recorder, "step", None),
    )
    with recorder:
        _run_flow(args, monkeypatch)
    assert (run / "results.json").is_file()
    early = [f"step {s}: {name} at {where}" for s, name, where in recorder.found if s < STEPS - 1]
    assert not early, "host reads in training steps:\n" + "\n".join(early)
    last = [where for s, name, where in recorder.found if s == STEPS - 1]
    assert any("progress.py" in w for w in last), f"the bar's read at the last step was not seen: {last}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["task-padded-rope", "corpus-packed-t5", "translation-padded-shaw"])
def test_cuda_training_steps_make_no_host_sync(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, torch's own sync detector (``set_sync_debug_mode("warn")``) in steps 1 … last-1 (step 0
    builds the optimiser state and compiles kernels; the last step's bar reads its metrics): no
    synchronising CUDA call but those made while compiling (a batch of a new length may recompile a
    Flex kernel; compiling is not the step's work)."""
    checked = range(1, STEPS - 1)
    watch_training_steps(
        monkeypatch,
        lambda step: torch.cuda.set_sync_debug_mode("warn" if step in checked else "default"),
        lambda step: torch.cuda.set_sync_debug_mode("default"),
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run_flow(_flow_args(case, tmp_path / "run", "gpu"), monkeypatch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (tmp_path / "run" / "results.json").is_file()
    compiling = ("_inductor", "_dynamo", "triton")
    syncs = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchronizing CUDA operation" in str(w.message) and not any(c in w.filename for c in compiling)
    ]
    assert not syncs, "synchronising CUDA calls in training steps:\n" + "\n".join(syncs)


# ------------------------------------------------------------------------------------ every PE
def _pe_options(pe: str) -> dict[str, Any]:
    """Options that put a PE's own fast path in reach of a 40-token batch (Shaw's least length)."""
    return (
        {"shortcut_min_len": 0} if "shortcut_min_len" in inspect.signature(ENCODINGS[pe]).parameters else {}
    )


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed", "translation-padded"])
@pytest.mark.parametrize("pe", posformer.list_encodings())
def test_no_pe_reads_on_the_host_in_a_training_step(
    pe: str, rows: str, tiny_model: Any, decoder_batch: Any
) -> None:
    """Forward and backward of a tiny model, the second time (the first fills the caches), with
    nothing read on the host and no host data copied to the device: the step of every PE, on plain,
    left-padded and packed decoder rows and on a padded translation batch."""
    if rows == "translation-padded":
        model = tiny_model(pe, "encoder_decoder", pe_options=_pe_options(pe)).train()
        src, tgt = (
            torch.randint(0, 13, (2, n), generator=torch.Generator().manual_seed(n)) for n in (30, 20)
        )
        src_mask = torch.arange(30) < torch.tensor([[30], [23]])
        tgt_mask = torch.arange(20) < torch.tensor([[20], [14]])
        args: tuple = (src, tgt, src_mask, tgt_mask)
    else:
        model = tiny_model(pe, pe_options=_pe_options(pe)).train()
        args = decoder_batch(rows)
    recorder = HostReads()
    for attempt in range(2):
        with recorder:
            recorder.step = attempt if attempt else None
            model.zero_grad()
            model(*args).float().logsumexp(-1).mean().backward()
            recorder.step = None
    found = [f"{name} at {where}" for _, name, where in recorder.found]
    assert not found, "host reads in a training step:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------ masks
def test_masks_that_hide_nothing_are_left_out_on_the_host() -> None:
    full, padded = torch.ones(2, 4, dtype=torch.bool), torch.tensor([[True] * 4, [True, True, False, False]])
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert "attention_mask" not in without_full_masks({"input_ids": ids, "attention_mask": full})
    kept = without_full_masks({"input_ids": ids, "attention_mask": padded})
    assert kept["attention_mask"] is padded
    # the encoder's mask stays (cross-attention takes it as it is); the target's goes
    out = without_full_masks({"src_ids": ids, "src_mask": full, "tgt_ids": ids, "tgt_mask": full})
    assert set(out) == {"src_ids", "src_mask", "tgt_ids"}
    assert without_full_masks([ids, full])[1] is full  # not a mapping: as it is


# ------------------------------------------------------------------------------------ the NaN guard
def _trainer(world_size: int = 1, scaler: Any = None, log_every: int = 50) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world_size,
        precision_plugin=SimpleNamespace(scaler=scaler),
        global_step=3,
        log_every_n_steps=log_every,
        checkpoint_callback=None,
        optimizers=[],
    )


def _adamw(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.ones(3))
    return p, torch.optim.AdamW([p], lr=0.1, fused=fused)


def test_the_guard_skips_on_the_device_only_where_the_optimiser_can() -> None:
    assert skips_on_device(_trainer(), _adamw(fused=True)[1])
    assert not skips_on_device(_trainer(), _adamw(fused=False)[1])  # foreach: read on the host
    assert not skips_on_device(_trainer(world_size=2), _adamw(fused=True)[1])  # no process group to agree
    assert skips_on_device(_trainer(scaler=object()), _adamw(fused=True)[1])  # fp16: a marked gradient
    assert not skips_on_device(_trainer(scaler=object()), _adamw(fused=False)[1])  # already unscaled


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), 2.5])
def test_a_fused_step_with_a_bad_loss_leaves_the_weights_and_the_guard_names_it(loss: float) -> None:
    """No host read before the optimiser step; the update of a non-finite step never happens; the
    guard's read names the step and the value."""
    p, opt = _adamw(fused=True)
    guard, trainer = NonFiniteLossGuard(), _trainer()
    trainer.optimizers = [opt]
    recorder = HostReads()
    with recorder:
        recorder.step = 3
        guard.on_before_backward(trainer, None, torch.tensor(loss))
        p.grad = torch.full((3,), loss)
        guard.on_before_optimizer_step(trainer, None, opt)
        opt.step()
        guard.on_train_batch_end(trainer, None, None, None, 0)  # step 3: not a log step
        recorder.step = None
    assert not recorder.found, recorder.found
    assert "found_inf" not in opt.__dict__  # the step's flag is not left for the next one
    bad = not torch.isfinite(torch.tensor(loss))
    assert torch.equal(p.detach(), torch.ones(3)) == bad
    assert int(opt.state[p]["step"]) == (0 if bad else 1)
    if bad:
        with pytest.raises(TrainingDivergedError, match=rf"became {loss} at step 3 .*skipped the update"):
            guard.check(trainer)
    else:
        guard.check(trainer)
    guard.check(trainer)  # read once: nothing pending


def test_the_host_way_reads_before_the_update_and_counts_every_micro_batch() -> None:
    p, opt = _adamw(fused=False)
    guard, trainer = NonFiniteLossGuard(), _trainer()
    guard.on_before_backward(trainer, None, torch.tensor(float("nan")))  # the first micro-batch
    guard.on_before_backward(trainer, None, torch.tensor(1.0))
    with pytest.raises(TrainingDivergedError, match=r"became nan at step 3 .*before the bad update"):
        guard.on_before_optimizer_step(trainer, None, opt)
    assert "found_inf" not in opt.__dict__


class NanLogits(Callback):
    """Test-only hook: the logits of the training batch at step ``at`` are NaN (the weights stay); in
    process ``rank`` only, if given. ``record``: a folder where each process appends, after every
    step, the step and whether all its weights are finite (``rank<r>.txt``)."""

    def __init__(self, at: int = 4, rank: int | None = None, record: str | None = None) -> None:
        self.at, self.rank, self.record, self._hook = at, rank, record, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at and self.rank in (None, trainer.global_rank):
            self._hook = pl_module.model.register_forward_hook(lambda m, a, out: out * float("nan"))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.record is not None:
            finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())
            with open(Path(self.record) / f"rank{trainer.global_rank}.txt", "a") as f:
                f.write(f"{trainer.global_step} {finite}\n")


def test_a_fused_run_skips_the_bad_step_and_stops_before_the_next_checkpoint(
    out_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The whole flow with the fused optimiser: the NaN of step 4 is read when the checkpoint of
    step 6 is about to be written; nothing is written after step 4, and the message says so."""
    from posformer.checkpoints import safe_load_checkpoint

    args = [
        "optim.fused=true",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=100",
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "+callbacks.nan_logits._target_=tests.lit.test_host_sync.NanLogits",
    ]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, "training loss became nan at step 4", "skipped the update", "Last good checkpoint"
    )
    steps = [safe_load_checkpoint(p)["global_step"] for p in (out_dir / "checkpoints").glob("*step*.ckpt")]
    assert max(steps) == 4


@pytest.mark.slow  # DDP: two spawned processes (~25 s)
def test_ddp_processes_skip_a_bad_step_together(tmp_path: Path, cache_dir: Path) -> None:
    """Two processes (gloo) with ``optim.fused=true``: process 0's loss is NaN at step 4; the flag's
    all-reduce makes both skip that update (their gradients, averaged, are NaN in both: process 1
    would otherwise take it), so both keep finite weights; they stop at the read before the
    checkpoint of step 6, and none is written after step 4."""
    import os
    import subprocess

    from posformer.checkpoints import safe_load_checkpoint

    args = ["trainer=ddp", "optim.fused=true", f"paths.log_dir={tmp_path}", f"paths.cache_dir={cache_dir}"]
    args += [*TINY_DATA, "data.n_val=64", *TINY_MODEL]
    args += ["trainer.max_steps=8", "trainer.val_check_interval=8", "trainer.log_every_n_steps=100"]
    args += ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=2"]
    args += ["logger=none", "callbacks.pe_heatmap=null", "callbacks.progress_bar=null"]
    args += [
        "+trainer.enable_progress_bar=false",
        "+callbacks.nan_logits._target_=tests.lit.test_host_sync.NanLogits",
    ]
    args += ["+callbacks.nan_logits.rank=0", f"+callbacks.nan_logits.record={tmp_path}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }  # the tests package
    proc = subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "at step 4" in text and "skipped the update" in text, text[-3000:]
    ckpts = list(tmp_path.glob("train/runs/*/checkpoints/*step*.ckpt"))
    assert ckpts and max(safe_load_checkpoint(p)["global_step"] for p in ckpts) == 4
    for rank in (0, 1):
        steps = (tmp_path / f"rank{rank}.txt").read_text().split("\n")[:-1]
        assert steps == [f"{step} True" for step in range(1, 7)], (rank, steps)

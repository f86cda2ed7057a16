"""fp16 mixed precision (``trainer.precision=16-mixed``, Lightning's ``GradScaler``) with the fused
optimiser: what a pre-Ampere GPU runs (``precision: auto`` picks ``16-mixed`` there, and
``optim.fused: null`` picks the fused AdamW on CUDA).

Lightning leaves a fused optimiser's gradients scaled until its step and then refuses to clip them
(``RuntimeError: The current optimizer, AdamW, does not allow for gradient clipping``): every such run
stopped at its first step. posformer unscales them in the module's ``on_before_optimizer_step``; the
fused path must then train exactly like Lightning's own path for the ``foreach`` optimiser.

Lightning turns ``16-mixed`` into ``bf16-mixed`` on the CPU; the ``fp16_on_cpu`` fixture gives the
trainer the CUDA plugin's fp16 ``GradScaler`` on the CPU instead (torch has CPU kernels for both the
scaler and the fused optimiser), so these runs take the GPU's path here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

import posformer
from posformer.checkpoints import safe_load_checkpoint
from posformer.lit.callbacks import NonFiniteLossGuard, TrainingDivergedError
from tests.cli_cases import TINY_RUN, assert_clean_failure, train_cli
from tests.lit.test_host_sync import HostReads, _flow_args, assert_steps_read_nothing

CLIP = 0.05  # below every step's gradient norm at this size: each step is clipped


@pytest.fixture
def fp16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainer.precision=16-mixed`` on the CPU gets the fp16 ``GradScaler`` of a GPU run."""
    from lightning.pytorch.trainer.connectors import accelerator_connector

    monkeypatch.setattr(
        accelerator_connector, "MixedPrecision", lambda precision, device: MixedPrecision("16-mixed", device)
    )


class GradNorms(Callback):
    """Test-only: after every step, the logged gradient norm (before clipping), the norm of the
    gradients the optimiser stepped with (after clipping; Lightning zeroes them at the next step's
    start) and the scaler's scale, appended to ``record`` as JSON lines."""

    def __init__(self, record: str) -> None:
        self.record = record

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        grads = [p.grad.float() for p in pl_module.parameters() if p.grad is not None]
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        row = {
            "logged": float(trainer.callback_metrics["train/grad_norm"]),
            "clipped": float(clipped),
            "scale": float(trainer.precision_plugin.scaler.get_scale()),
        }
        with open(self.record, "a") as f:
            f.write(json.dumps(row) + "\n")


def _train(
    fused: bool, run: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, trainer: str
) -> tuple[dict, list]:
    record = run.parent / f"norms_{fused}.jsonl"
    args = [
        f"trainer={trainer}",
        f"optim.fused={str(fused).lower()}",
        "trainer.precision=16-mixed",
        f"trainer.gradient_clip_val={CLIP}",
        "+callbacks.norms._target_=tests.lit.test_fp16_scaler.GradNorms",
        f"+callbacks.norms.record={record}",
    ]
    code, text = train_cli(args, run, cache, monkeypatch, capsys, tiny=TINY_RUN)
    assert code == 0, text[-3000:]
    weights = safe_load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]
    return weights, [json.loads(line) for line in record.read_text().splitlines()]


def test_fp16_with_the_fused_optimiser_clips_and_trains_like_foreach(
    tmp_path: Path, cache_dir: Path, fp16_on_cpu: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Both runs: the gradients are unscaled before they are logged and clipped (the logged norms
    are the same, not 65,536× larger), each step is clipped to ``CLIP``; the weights agree to the
    rounding of the two Adam kernels."""
    _assert_fused_trains_like_foreach(tmp_path, cache_dir, monkeypatch, capsys, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp16_with_the_fused_optimiser_clips_and_trains_like_foreach(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The same on a GPU, with Lightning's own fp16 plugin (``trainer=gpu trainer.precision=16-mixed``)."""
    _assert_fused_trains_like_foreach(tmp_path, cache_dir, monkeypatch, capsys, "gpu")


def _assert_fused_trains_like_foreach(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, trainer: str
) -> None:
    fused, fused_norms = _train(True, tmp_path / "fused", cache_dir, monkeypatch, capsys, trainer)
    foreach, foreach_norms = _train(False, tmp_path / "foreach", cache_dir, monkeypatch, capsys, trainer)
    assert len(fused_norms) == len(foreach_norms) == 4
    for a, b in zip(fused_norms, foreach_norms):
        assert a["scale"] == b["scale"] == 2.0**16  # no step overflowed: each one updated the weights
        assert a["logged"] == pytest.approx(b["logged"], rel=1e-4) and a["logged"] > 2 * CLIP
        assert a["clipped"] == pytest.approx(CLIP, rel=1e-4) and b["clipped"] == pytest.approx(CLIP, rel=1e-4)
    assert fused.keys() == foreach.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], foreach[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fp16_fused_steps_read_nothing_on_the_host(
    tmp_path: Path, fp16_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scaler's scale, unscale, skip flag and update, the guard's mark: all on the device."""
    args = [*_flow_args("task-padded-rope", tmp_path / "run", "cpu"), "trainer.precision=16-mixed"]
    assert_steps_read_nothing(args, tmp_path / "run", monkeypatch)


def _scaled_step(loss: torch.Tensor, guard: NonFiniteLossGuard | None) -> tuple[torch.nn.Parameter, Any]:
    """One fp16-scaled step of a fused AdamW in Lightning's order: the scaled loss's backward, the
    callbacks' ``on_before_optimizer_step`` (the guard's), the module's unscale, the scaler's step."""
    from types import SimpleNamespace

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    trainer = SimpleNamespace(
        world_size=1,
        precision_plugin=SimpleNamespace(scaler=scaler),
        global_step=3,
        log_every_n_steps=50,
        checkpoint_callback=None,
        optimizers=[opt],
    )
    scaled = scaler.scale((p * 2.0).sum() + loss)  # the loss's bad part is a constant: finite gradients
    if guard is not None:
        guard.on_before_backward(trainer, None, scaled)
    scaled.backward()
    if guard is not None:
        guard.on_before_optimizer_step(trainer, None, opt)
    scaler.unscale_(opt)  # PosformerModule.on_before_optimizer_step
    scaler.step(opt)
    scaler.update()
    return p, trainer


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_guard_makes_the_scaler_skip_a_bad_loss_with_finite_gradients(bad: float) -> None:
    """The scaler skips a step only for non-finite gradients; a loss that is non-finite in a part with
    no gradient (here a constant) would be stepped on. The guard's mark makes it skip, with nothing
    read on the host, and its read names the step."""
    p, _ = _scaled_step(torch.tensor(bad), guard=None)
    assert not torch.equal(p.detach(), torch.ones(3))  # without the guard: updated
    guard, recorder = NonFiniteLossGuard(), HostReads()
    with recorder:
        recorder.step = 3
        p, trainer = _scaled_step(torch.tensor(bad), guard)
        recorder.step = None
    assert not recorder.found, recorder.found
    assert torch.equal(p.detach(), torch.ones(3))
    with pytest.raises(TrainingDivergedError, match=r"at step 3 .*skipped the update"):
        guard.check(trainer)
    p, trainer = _scaled_step(torch.tensor(1.0), NonFiniteLossGuard())  # a good loss: stepped, no error
    assert not torch.equal(p.detach(), torch.ones(3))


@pytest.mark.slow  # ~8 s
def test_a_fused_fp16_run_skips_the_bad_step_and_stops_before_the_next_checkpoint(
    out_dir: Path, cache_dir: Path, fp16_on_cpu: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = [
        "optim.fused=true",
        "trainer.precision=16-mixed",
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


@pytest.mark.parametrize("pe", posformer.list_encodings())
def test_every_pe_trains_under_fp16_with_its_scaler(pe: str) -> None:
    """Every registered PE, 20 steps of fp16 autocast with the scaler, the fused AdamW and norm clipping
    (Lightning's own ``16-mixed`` on the CPU is bf16, so the precision test of ``test_reliability.py``
    never sees float16): a finite loss, and no step overflowed (the scale never dropped: every update
    happened)."""
    import lightning as L

    from tests.lit.test_reliability import _batches, _module

    module = _module(pe, seed=0)
    module.optim_cfg = {**module.optim_cfg, "fused": True}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        max_steps=20,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=_batches(20))
    loss = float(trainer.callback_metrics["train/loss"])
    assert trainer.global_step == 20 and math.isfinite(loss), (pe, loss)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16
    assert all(group["fused"] for group in trainer.optimizers[0].param_groups)

"""Gradient clipping where Lightning's plugins refuse it: FSDP by norm (``trainer=fsdp`` inherits
``gradient_clip_val: 1.0``, and Lightning's FSDP plugin raises "``gradient_clip_algorithm='norm'`` is
currently not supported" at the first step). ``PosformerModule.configure_gradient_clipping`` clips
by the root FSDP module's ``clip_grad_norm_`` (the norm over every process's shards). FSDP needs a
GPU: the CPU tests give the module a stand-in root; the ``cuda`` test trains ``trainer=fsdp`` on one
GPU. fp16's scaler with a fused optimiser, the other refusal, is in ``tests/lit/test_fp16_scaler.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from posformer.lit.modules import LanguageModelModule
from tests.cli_cases import TINY_RUN, train_cli


class ShardedRoot(torch.nn.Module):
    """Stands in for FSDP's root module: records the calls of its ``clip_grad_norm_``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[float] = []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.calls.append(max_norm)
        return torch.zeros(())


def _module_with_grads(root: torch.nn.Module | None, clip: float, how: str) -> tuple[Any, Any]:
    module = LanguageModelModule(
        model={"vocab_size": 8, "d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "pe": "rope"},
        optim={"lr": 1e-3},
        schedule={"name": "constant", "warmup_steps": 1},
    )
    module._trainer = SimpleNamespace(
        model=root if root is not None else module,
        precision_plugin=Precision(),
        gradient_clip_val=clip,
        gradient_clip_algorithm=how,
    )
    for p in module.parameters():
        p.grad = torch.full_like(p, 3.0)
    return module, torch.optim.AdamW(module.parameters())


def _norm(module: Any) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in module.parameters()])))


def test_fsdp_clips_by_the_root_modules_norm() -> None:
    root = ShardedRoot()
    module, opt = _module_with_grads(root, 0.5, "norm")
    before = _norm(module)
    module.configure_gradient_clipping(opt, 0.5, "norm")
    assert root.calls == [0.5]
    assert _norm(module) == before  # the root clipped (the stand-in does nothing), not Lightning's plugin


def test_fsdp_clips_by_value_through_lightning() -> None:
    root = ShardedRoot()
    module, opt = _module_with_grads(root, 0.5, "value")
    module.configure_gradient_clipping(opt, 0.5, "value")
    assert root.calls == []
    assert all(bool((p.grad == 0.5).all()) for p in module.parameters())


@pytest.mark.parametrize("clip", [0.0, None])
def test_no_clipping_asked_calls_nothing(clip: float | None) -> None:
    root = ShardedRoot()
    module, opt = _module_with_grads(root, clip, "norm")
    before = _norm(module)
    module.configure_gradient_clipping(opt, clip, "norm")
    assert root.calls == [] and _norm(module) == before


def test_one_device_clips_by_norm_through_lightning() -> None:
    module, opt = _module_with_grads(None, 0.5, "norm")
    module.configure_gradient_clipping(opt, 0.5, "norm")
    assert _norm(module) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fsdp_on_one_gpu_trains_with_its_default_clipping(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``trainer=fsdp`` (norm clipping at 1.0, bf16-mixed) on one GPU: 4 steps and the evaluation."""
    code, text = train_cli(
        ["trainer=fsdp", "trainer.devices=1"], tmp_path / "run", cache_dir, monkeypatch, capsys, tiny=TINY_RUN
    )
    assert code == 0, text[-3000:]
    assert (tmp_path / "run" / "results.json").is_file()

"""Heads smaller than FlexAttention's GPU kernel takes: SDPA on CUDA, never a failure at the first step.

Inductor lowers FlexAttention for a GPU only for heads of at least 16 dimensions (Triton's ``tl.dot``
reduces over at least 16; below, inductor raises "NYI: embedding dimension of the query, key, and value
must be at least 16"). The CPU kernel takes any size, so a CPU run never sees it: a small model with
many heads (``model=decoder_tiny model.n_heads=8``, Dh 8) trained every bias PE fine on the CPU and
failed at the first training step on a GPU, where ``auto`` picks Flex for biases. The decision now
keeps such calls off Flex on CUDA (the grid at Dh 8: ``tests/model/test_backend_decision.py``), forced Flex
is refused in one line, and a ``cuda`` test trains such a model on a GPU. On the CPU, a training step
on CUDA's paths (``tests/flex_lowering.py::as_on_cuda``, which makes inductor's GPU input checks)
reproduces the failure when the rule is taken away.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from posformer import api
from posformer.configs import checks
from posformer.configs.settings import read_train
from posformer.errors import ConfigError
from posformer.model.backends import flex
from tests.flex_lowering import as_on_cuda

CUDA = torch.cuda.is_available()


def test_forced_flex_with_heads_under_16_is_refused_before_training_on_cuda(
    monkeypatch: Any, tmp_path: Any
) -> None:
    """Inductor lowers Flex for a GPU only for heads of at least 16 dimensions: where training runs on
    CUDA (here faked), forced Flex with d_model/n_heads = 8 is one line before any work; 16 passes."""
    monkeypatch.setattr(checks, "cuda_problem", lambda accelerator: None)
    base = ["model=decoder_tiny", "model.attention_backend=flex", "trainer.accelerator=gpu"]
    paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}"]
    with pytest.raises(
        ConfigError, match=r"^model.attention_backend=flex needs heads of at least 16 .* = 8;"
    ):
        read_train(api.compose("train", [*base, "model.n_heads=8", *paths]))  # 64 / 8
    read_train(api.compose("train", [*base, "model.n_heads=4", *paths]))  # 64 / 4 = 16


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("pe", ["alibi", "t5", "fire", "forget_alibi", "shaw", "cope"])
def test_cuda_heads_of_8_train_and_evaluate(tiny_model: Any, pe: str) -> None:
    """On a GPU a model with heads of 8 dimensions trains (finite gradients for every parameter) and
    evaluates under ``auto`` for PEs that take Flex or a Flex shortcut at larger heads."""
    model = tiny_model(pe, d_model=32, n_heads=4, n_layers=2).cuda().train()  # Dh 8
    x = torch.randint(1, 13, (2, 300), device="cuda")  # 300: past Shaw's and CoPE's shortcut lengths
    model(x).float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    with torch.no_grad():
        assert torch.isfinite(model.eval()(x)).all()


@pytest.mark.parametrize("pe", ["t5", "shaw"])  # Flex for a learned bias; Flex for a shortcut's far keys
def test_heads_of_8_train_on_cudas_paths_and_fail_there_without_the_rule(
    pe: str, tiny_model: Any, decoder_batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's decisions rehearsed on the CPU, with the checks inductor's GPU lowering makes: a model
    with heads of 8 trains (SDPA's paths); with the head-size rule taken away it takes Flex and meets
    the GPU's error, as every such model did at its first GPU step: ``auto`` now survives it on the
    other paths and records why (``attention_fallback``)."""
    as_on_cuda(monkeypatch)
    options = {"shortcut_min_len": 0, "max_relative_position": 4} if pe == "shaw" else {}
    model = tiny_model(pe, d_model=32, n_heads=4, n_layers=2, pe_options=options).train()  # Dh 8
    args = decoder_batch("packed")
    try:
        model(*args).float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in model.parameters())
        assert model.attention_fallback is None
        monkeypatch.setattr(flex, "head_dim_fits", lambda head_dim, device_type: True)
        model(*args).float().logsumexp(-1).mean().backward()
        error = "embedding dimension of the query, key, and value must be at least 16"
        assert error in (model.attention_fallback or ""), model.attention_fallback
    finally:
        torch._dynamo.reset()

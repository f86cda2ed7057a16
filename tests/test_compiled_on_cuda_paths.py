"""``compile.enabled=true`` on a GPU, rehearsed on the CPU: a whole compiled model on CUDA's paths.

On CUDA a compiled model (``compile.enabled=true``, ``Module.compile``) traces FlexAttention inside
its graph (the learned biases' captured tensors built inside it too), Shaw's and CoPE's shortcuts
with Flex's differentiable log-sum-exp, and Flex again in the regions a graph break leaves eager. None
of that runs on the CPU, where the decision picks SDPA's paths. Here each model takes CUDA's decisions
with CPU tensors (:func:`flex_lowering.as_on_cuda`), is compiled with AOT autograd and the eager
kernels, inductor's joint-graph check run on each Flex backward, and one training step is compared
with the eager model on the CPU's own paths: the logits and every parameter gradient, fp32 to 1e-5.
What is left to the GPU is inductor's code generation (``scripts/gpu_speed.sh`` stage mc).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flex_lowering import as_on_cuda, checked_backend

from posformer.model.backends import flex
from posformer.pe import list_encodings

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")
ROWS = ("plain", "left-padded", "packed")
#: the cases that run by default, with the path CUDA takes for them: a learned bias's offset vector
#: (captured, built inside the compiled graph), a feature bias on packed rows, a shortcut; the rest of
#: every PE x rows is ``slow`` (FIRE's elementwise bias, documents without a bias, ...)
QUICK = {("t5", "plain"): "flex", ("forget_alibi", "packed"): "flex", ("shaw", "packed"): "shortcut"}


def _cases() -> list[Any]:
    return [
        pytest.param(pe, rows, marks=() if (pe, rows) in QUICK else pytest.mark.slow, id=f"{pe}-{rows}")
        for pe in list_encodings()
        for rows in ROWS
    ]


def _step(model: torch.nn.Module, args: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: the logits and every parameter gradient, by name."""
    model.zero_grad()
    logits = model(*args)
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize(("pe", "rows"), _cases())
def test_a_compiled_model_on_cudas_paths_trains_like_the_eager_cpu_model(
    pe: str, rows: str, tiny_model: Any, decoder_batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch._dynamo.reset()
    options = {"shortcut_min_len": 0} if pe == "shaw" else {}  # Shaw's shortcut at 40 tokens too
    model = tiny_model(pe, d_model=32, n_heads=2, n_layers=2, pe_options=options).train()  # Dh 16
    args = decoder_batch(rows)
    ref_logits, ref_grads = _step(model, args)
    used: list[str] = []
    checked = as_on_cuda(monkeypatch)
    from posformer.model import attention

    choose = attention.choose
    monkeypatch.setattr(attention, "choose", lambda *a, **kw: (used.append(choose(*a, **kw)), used[-1])[1])
    backend, compiled_checked = checked_backend()
    try:
        model.compile(backend=backend, dynamic=None)  # what compile.enabled=true does, its defaults
        logits, grads = _step(model, args)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=f"d{name}")
    assert used and QUICK.get((pe, rows), used[0]) in used  # CUDA's decisions were taken
    if {"flex", "shortcut"} & set(used):  # CUDA's Flex ran: its backward traced, inductor's check passed
        assert checked or compiled_checked, used

"""A FlexAttention failure under ``model.attention_backend=auto`` slows a run instead of ending it.

On CUDA, ``auto`` sends bias PEs to compiled FlexAttention. Past posformer's graph budget
(:data:`~posformer.model.backends.flex.RECOMPILE_LIMIT`) or when dynamo, inductor or Triton fail to
build a kernel, the model records the failure (:class:`~posformer.model.policy.FlexFallback`), warns
once, and its remaining calls take SDPA or the materialised paths; ``results.json`` says so as
``attention_fallback``. An explicit ``attention_backend=flex`` keeps the error. CUDA's paths are taken
on the CPU by ``tests/flex_lowering.py::as_on_cuda`` (Flex traced as on CUDA, with gradients).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from posformer.model.backends import flex
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.model.schedule import Span
from tests.cli_cases import TINY
from tests.flex_lowering import as_on_cuda, record_choices

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")


@pytest.fixture
def cuda_paths(monkeypatch: pytest.MonkeyPatch):
    """CUDA's attention decisions with Flex traced on the CPU, a fresh dynamo cache, a budget of 1 graph."""
    torch._dynamo.reset()
    as_on_cuda(monkeypatch)
    used = record_choices(monkeypatch)
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    yield used
    torch._dynamo.reset()


def _batches() -> list[torch.Tensor]:
    """Token ids of three lengths in two batch sizes: more graph kinds than a budget of one."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 13, shape, generator=g) for shape in ((2, 16), (1, 9), (3, 33))]


def test_past_the_graph_budget_auto_falls_back_and_computes_the_same_attention(
    cuda_paths: list[str], tiny_model, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model("alibi", d_model=32)  # heads of 16 dimensions: CUDA's Flex takes them
    reference = tiny_model("alibi", d_model=32, attention_backend="sdpa")
    with caplog.at_level(logging.WARNING, logger="posformer.model"), torch.no_grad():
        outputs = [model(ids) for ids in _batches()]
        expected = [reference(ids) for ids in _batches()]
    assert "flex" in cuda_paths, cuda_paths  # it ran Flex first
    assert cuda_paths[-1] != "flex"  # and the last calls took another path
    reason = model.attention_fallback
    assert reason is not None and "FlexRecompileError" in reason and "1 graphs" in reason
    warnings = [r for r in caplog.records if "FlexAttention failed" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()  # once per model, one line
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert reference.attention_fallback is None


def test_an_explicit_flex_keeps_the_error(cuda_paths: list[str], tiny_model) -> None:
    model = tiny_model("alibi", d_model=32, attention_backend="flex")
    with torch.no_grad(), pytest.raises(flex.FlexRecompileError):
        for ids in _batches():
            model(ids)
    assert model.attention_fallback is None


def test_a_compile_error_falls_back_too(monkeypatch: pytest.MonkeyPatch, tiny_model) -> None:
    """An inductor/Triton failure (here: a backend that raises as inductor does) is a compile failure."""
    torch._dynamo.reset()
    as_on_cuda(monkeypatch)

    def failing_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        raise RuntimeError("triton: out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, backend=failing_backend, dynamic=True)
    monkeypatch.setattr(flex, "kernel", lambda device_type, compiled_=True: compiled)
    model = tiny_model("t5", d_model=32)
    with torch.no_grad():
        out = model(_batches()[0])
    assert torch.isfinite(out).all()
    assert "BackendCompilerFailed" in (model.attention_fallback or ""), model.attention_fallback
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (flex.FlexRecompileError("FlexAttention compiled more than 16 graphs"), True),
        (torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("lowering"), None), True),
        (RuntimeError("wrapped"), False),
        (torch.OutOfMemoryError("CUDA out of memory"), False),
        (ValueError("a bug in posformer's own code"), False),
    ],
)
def test_what_counts_as_a_compile_failure(exc: BaseException, expected: bool) -> None:
    assert flex.is_compile_failure(exc) is expected


def test_a_compile_failure_behind_another_error_counts() -> None:
    try:
        try:
            raise flex.FlexRecompileError("FlexAttention compiled more than 16 graphs")
        except flex.FlexRecompileError as inner:
            raise RuntimeError("while running the model") from inner
    except RuntimeError as outer:
        assert flex.is_compile_failure(outer)


def test_the_fallback_record_belongs_to_the_model_and_survives_switches(tiny_model) -> None:
    model = tiny_model("alibi")
    policy = model.attention_policy
    policy.fallback.record("first")
    assert not policy.flex_usable and model.attention_fallback == "first"
    model.attention_policy = BackendPolicy(off=frozenset({"offset"}))  # an ablation's switch
    assert model.attention_policy.fallback is policy.fallback
    assert not policy.fallback.record("second") and model.attention_fallback == "first"
    assert tiny_model("alibi").attention_fallback is None  # another model: its own record
    assert BackendPolicy() == BackendPolicy(fallback=policy.fallback)  # not part of the policy's identity


@pytest.mark.parametrize("causal", [True, False])
def test_a_sliding_window_block_mask_is_built_once_and_equals_the_contexts(causal: bool) -> None:
    span, tq, tk = Span("sliding", 6), 24, 40
    first = flex.span_block_mask(tq, tk, causal, span, 3, torch.device("cpu"))
    assert flex.span_block_mask(tq, tk, causal, span, 3, torch.device("cpu")) is first
    pos = torch.arange(tk)[None]
    ctx = AttentionContext(None, pos[:, tk - tq :], pos, causal=causal, span=span, key_start=3)
    dense = first.to_dense()[0, 0]  # (Tq / 128, Tk / 128) blocks
    own = flex.build_block_mask(
        lambda b, h, q, k: ctx.visible_fn()(b, q, k), None, tq, tk, torch.device("cpu")
    )
    assert torch.equal(dense, own.to_dense()[0, 0])
    mask = ctx.keep(0, tq, tk, torch.device("cpu"))[0, 0]  # (Tq, Tk) bool
    built = first.mask_mod(
        torch.tensor(0), torch.tensor(0), torch.arange(tq)[:, None], torch.arange(tk)[None]
    )
    assert torch.equal(built, mask)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_past_the_graph_budget_auto_falls_back(monkeypatch: pytest.MonkeyPatch, tiny_model) -> None:
    """The real compiled kernel on a GPU: past a budget of one graph, ``auto`` goes on without Flex."""
    flex.reset_compiled()
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    model = tiny_model("alibi", d_model=32).cuda()
    reference = tiny_model("alibi", d_model=32, attention_backend="sdpa").cuda()
    with torch.no_grad():
        outputs = [model(ids.cuda()) for ids in _batches()]
        expected = [reference(ids.cuda()) for ids in _batches()]
    assert model.attention_fallback is not None
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    flex.reset_compiled()


@pytest.mark.slow  # a training run of 4 steps on CUDA's traced paths (~20 s)
def test_a_training_run_past_the_graph_budget_finishes_and_records_it(
    cuda_paths: list[str], tmp_path: Path
) -> None:
    from hydra import compose, initialize_config_module

    from posformer.training import run

    overrides = [
        *TINY,
        "model.d_model=32",  # heads of 16: CUDA's Flex takes them
        "pe=alibi",
        "trainer=cpu",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    results = run(cfg)
    assert "flex" in cuda_paths and cuda_paths[-1] != "flex"
    written = json.loads((tmp_path / "run" / "results.json").read_text())
    assert "FlexRecompileError" in written["attention_fallback"]
    assert written["attention_fallback"] == results["attention_fallback"]
    assert all(row["loss"] == row["loss"] for row in written["results"])  # every length evaluated

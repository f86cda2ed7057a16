"""FlexAttention compiles a bounded set of graphs, and past the bound fails in one line.

On a GPU, evaluation of an encoder-decoder sat at "evaluating 0/26" after a FlexAttention warning: the
compiled kernel had run out of graphs and torch fell back, silently, to an eager kernel that
materialises every score. These tests count the graphs the production call pattern needs, on the CPU:
the kernel is compiled as on CUDA (``dynamic=True``) with a counting backend that runs each graph as
traced (no code generation), so dynamo's guards — the thing that decides a recompile — are the real
ones. Past :data:`~posformer.model.backends.flex.RECOMPILE_LIMIT` a call raises
:class:`~posformer.model.backends.flex.FlexRecompileError` instead of falling back.
"""

from __future__ import annotations

import functools

import pytest
import torch

from posformer.model import ModelConfig, build_model
from posformer.model.backends import flex

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> GraphCounter:
    """``flex.kernel`` compiled as on CUDA (dynamic shapes) with a counting backend, fresh dynamo cache."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    count = GraphCounter()

    @functools.cache
    def kernel(device_type: str, compiled: bool):
        return torch.compile(flex_attention, backend=count, dynamic=True)

    monkeypatch.setattr(flex, "kernel", kernel)
    yield count
    torch._dynamo.reset()


def encdec(pe: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="encoder_decoder",
        vocab_size=20,
        d_model=16,
        n_heads=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=32,
        dropout=0.0,
        pe=pe,
        pe_apply={"encoder": True, "decoder": True, "cross": True},
        attention_backend="flex",
    )
    return build_model(cfg).eval()


def translation_batches(n: int = 26) -> list[tuple[torch.Tensor, ...]]:
    """``n`` padded batches of different source/target lengths; the last one holds a single sentence."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        b = 1 if i == n - 1 else 8
        s, t = 5 + (i * 7) % 23, 4 + (i * 5) % 19
        src, tgt = torch.randint(4, 20, (b, s), generator=g), torch.randint(4, 20, (b, t), generator=g)
        src_mask, tgt_mask = torch.ones(b, s, dtype=torch.bool), torch.ones(b, t, dtype=torch.bool)
        src_mask[0, -2:] = False
        tgt_mask[0, -1:] = False
        out.append((src, tgt, src_mask, tgt_mask))
    return out


@pytest.mark.slow  # dynamo traces 26 encoder-decoder batches (~4 s); the cheap cases below stay fast
def test_an_encoder_decoder_evaluation_over_26_lengths_compiles_a_handful_of_graphs(counter) -> None:
    model = encdec("t5")
    with torch.no_grad():
        for batch in translation_batches():
            model(*batch)
    # encoder self-attention, decoder self-attention and cross-attention, each with its padding mask,
    # for batches of 8 and of 1: lengths alone never compile a new graph
    assert 0 < counter.graphs <= 6, counter.graphs


@pytest.mark.parametrize(
    "pe",
    ["alibi", pytest.param("fire", marks=pytest.mark.slow)],  # fire: ~4 s of tracing; alibi stays fast
)
def test_a_decoder_over_many_lengths_compiles_once_per_kind(counter, pe: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=20,
        d_model=16,
        n_heads=2,
        n_layers=2,
        d_ff=32,
        dropout=0.0,
        pe=pe,
        attention_backend="flex",
    )
    model = build_model(cfg).eval()
    with torch.no_grad():
        for length in (16, 24, 40, 64, 100, 128, 200, 256, 300, 384, 512, 700):
            model(torch.randint(4, 20, (2, length)))
    # the first length, then one graph with symbolic lengths, then one past the first 128-row block:
    # twelve lengths, three graphs, and no more for any longer length
    assert 0 < counter.graphs <= 3, counter.graphs


def test_the_causal_block_mask_is_built_once_per_length() -> None:
    first = flex.causal_block_mask(32, 32, torch.device("cpu"))
    assert flex.causal_block_mask(32, 32, torch.device("cpu")) is first
    assert flex.causal_block_mask(16, 32, torch.device("cpu")) is not first


def test_past_the_recompile_limit_a_call_fails_in_one_line(counter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    model = encdec("alibi")
    with torch.no_grad(), pytest.raises(flex.FlexRecompileError) as info:
        for batch in translation_batches(4):
            model(*batch)
    message = str(info.value)
    assert "\n" not in message and "model.attention_backend=sdpa" in message


@pytest.mark.slow  # dynamo traces five encoder-decoder models (~4 s)
def test_each_run_of_a_multirun_counts_its_own_graphs(counter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs of ``posformer-train -m pe=...`` (and the checkpoints of one ``posformer-eval``) share a
    process; every PE compiles graphs of its own. The training flow and the evaluation harness call
    ``reset_compiled`` before each, so the limit bounds one model's graphs, not a sweep's."""
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 3)  # one model: encoder, decoder and cross-attention
    # each job sees other lengths (static shapes on the CPU: a graph per (Tq, Tk)); the offset-only
    # biases share one score_mod form, so it is the shapes that make a job's graphs its own
    batches = [b[:2] for b in translation_batches(3)]

    def one_run(pe: str, batch: tuple[torch.Tensor, torch.Tensor], reset: bool) -> None:
        if reset:
            flex.reset_compiled()
        with torch.no_grad():
            encdec(pe)(*batch)

    for pe, batch in zip(("alibi", "t5", "kerple"), batches):
        one_run(pe, batch, reset=True)
    with pytest.raises(flex.FlexRecompileError):
        for pe, batch in zip(("alibi", "t5"), batches):
            one_run(pe, batch, reset=False)

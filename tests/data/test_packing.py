"""Packed sequences: block-diagonal causal attention with positions restarting per document.

For every registered PE, the logits and gradients of each document in a packed row equal those of
the document run alone; the attention backends take the right paths with segment ids; the text and
synthetic datamodules emit packed rows (``data.pack=true``) with segment ids, restarting positions
and no label across documents; the config validator refuses bad packing settings; tiny training
runs with packing finish with a finite loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

import posformer
import posformer.model.attention as attention
from posformer.configs.composition import composition_error
from posformer.configs.settings import read_train
from posformer.data import EOS_ID, IGNORE_INDEX
from posformer.data.synthetic import SyntheticDataModule, decoder_example
from posformer.data.text import TextDataModule
from posformer.errors import ConfigError
from posformer.model.positions import document_positions
from posformer.pe import Offsets
from tests.cli_cases import QUIET, TINY_MODEL, TINY_TRAINING

#: two packed rows of 12 tokens: documents of different lengths
DOC_LENGTHS = [[5, 3, 4], [2, 6, 4]]
ROW = 12


def packed_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` (2, 12) and ``segment_ids`` (2, 12) of :data:`DOC_LENGTHS`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (len(DOC_LENGTHS), ROW), generator=g)
    seg = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in DOC_LENGTHS])
    return ids, seg


def documents() -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of :data:`DOC_LENGTHS`."""
    out = []
    for b, row in enumerate(DOC_LENGTHS):
        start = 0
        for n in row:
            out.append((b, start, start + n))
            start += n
    return out


def test_document_positions_restart_at_every_document():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [4, 4, 7, 7, 7, 7]])
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]


@pytest.mark.parametrize("pe", posformer.list_encodings())
def test_packed_documents_equal_documents_alone(pe, tiny_model):
    """Forward: each document's logits equal the document alone (1e-5, fp32). Backward: with a loss
    that sums one weighted term per document, the packed gradients equal the sum of the documents'."""
    model = tiny_model(pe, n_layers=2)
    ids, seg = packed_inputs()
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(end - start, 13, generator=g) for _, start, end in documents()]

    packed = model(ids, segment_ids=seg)  # (2, 12, V)
    loss = sum((packed[b, s:e] * w).sum() for (b, s, e), w in zip(documents(), weights))
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    alone_loss = 0.0
    for (b, s, e), w in zip(documents(), weights):
        alone = model(ids[b : b + 1, s:e])[0]  # (n, V)
        torch.testing.assert_close(packed[b, s:e], alone, atol=1e-5, rtol=1e-5)
        alone_loss = alone_loss + (alone * w).sum()
    alone_loss.backward()
    assert packed_grads, "no parameter received a gradient"
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def spy_backends(monkeypatch) -> list[tuple[str, object]]:
    """Record (backend name, whether the context had segment ids) of every attention call."""
    calls: list[tuple[str, object]] = []

    def wrap(name: str, run_backend):
        def run(q, k, v, ctx, layer, dropout_p):
            calls.append((name, ctx.segment_ids is not None))
            return run_backend(q, k, v, ctx, layer, dropout_p)

        return run

    monkeypatch.setattr(attention, "BACKENDS", {n: wrap(n, fn) for n, fn in attention.BACKENDS.items()})
    return calls


@pytest.mark.parametrize(
    ("pe", "unpacked", "packed"),
    [
        ("nope", "fused", "masked"),  # fused SDPA -> SDPA with the boolean block-diagonal mask
        ("rope", "fused", "masked"),
        ("alibi", "offset", "masked"),  # the offset vector assumes one arange of positions
        ("fire", "masked", "masked"),
        ("shaw", "shortcut", "shortcut"),  # its own attention; packed: a mask per region
    ],
)
def test_backends_with_segment_ids(pe, unpacked, packed, tiny_model, monkeypatch):
    model = tiny_model(pe, **({"pe_options": {"shortcut_min_len": 0}} if pe == "shaw" else {}))
    ids, seg = packed_inputs()
    calls = spy_backends(monkeypatch)
    with torch.enable_grad():
        model(ids)
        model(ids, segment_ids=seg)
    assert [name for name, _ in calls] == [unpacked, packed]


def test_mask_is_block_diagonal_causal():
    """The boolean mask the masked backend gets: visible iff same document and not in the future."""
    from posformer.model.context import AttentionContext

    _, seg = packed_inputs()
    pos = document_positions(seg)
    ctx = AttentionContext(None, pos, pos, causal=True, segment_ids=seg)
    keep = ctx.keep(0, ROW, ROW, torch.device("cpu"))  # (B, 1, T, T)
    i, j = torch.arange(ROW).view(-1, 1), torch.arange(ROW).view(1, -1)
    expected = (j <= i) & (seg[:, :, None] == seg[:, None, :])
    assert torch.equal(keep[:, 0], expected)


def test_segment_ids_refused_with_a_cache(tiny_model):
    model = tiny_model("rope")
    ids, seg = packed_inputs()
    with pytest.raises(ValueError, match="KV cache"):
        model(ids, segment_ids=seg, cache=model.new_cache())
    with pytest.raises(ValueError, match="shape of input_ids"):
        model(ids, segment_ids=seg[:, :-1])


# ----------------------------------------------------------------------------------------------- data
def check_packed_batch(batch: dict[str, torch.Tensor]) -> None:
    """Segment ids present and non-decreasing from 0; labels never cross a document boundary."""
    seg, labels, ids = batch["segment_ids"], batch["labels"], batch["input_ids"]
    assert seg.shape == ids.shape == labels.shape
    assert bool(batch["attention_mask"].all())
    assert (seg[:, 0] == 0).all() and (seg[:, 1:] >= seg[:, :-1]).all()
    assert (seg.max(1).values >= 1).any(), "no row holds more than one document"
    pos = document_positions(seg)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    assert (pos[starts] == 0).all() and (pos[~starts] > 0).all()
    ends = starts[:, 1:]  # token t is the last of a document followed by another one in the row
    # its label is no label (text) or its own EOS (tasks), never the next document's first token
    assert torch.isin(labels[:, :-1][ends], torch.tensor([IGNORE_INDEX, EOS_ID])).all()


def test_synthetic_pack_rows_hold_whole_examples(tmp_path):
    cfg = {"task": "copy", "train_len": [1, 4], "n_train": 40, "n_val": 8, "n_eval_per_length": 4}
    dm = SyntheticDataModule({**cfg, "pack": True, "cache_dir": str(tmp_path)}, "decoder", 0)
    ds = dm.train_dataset()
    assert len(ds) < 40  # several examples per row
    batch = next(iter(dm.train_dataloader()))
    check_packed_batch(batch)
    row = ds[0]
    examples = ds.rows[0]
    assert len(examples) >= 2
    for s, j in enumerate(examples):  # every segment is exactly one example, labels ending in EOS
        x, y = decoder_example(dm._train[j])
        inside = row["segment_ids"] == s
        assert torch.equal(row["input_ids"][inside], x) and torch.equal(row["labels"][inside], y)
        assert int(y[-1]) == EOS_ID
    pad = row["segment_ids"] == len(examples)
    assert (row["labels"][pad] == IGNORE_INDEX).all()
    assert "segment_ids" not in next(iter(dm.val_dataloader()))  # validation stays unpacked


def write_text(path: Path) -> Path:
    paras = [" ".join(["abcde"[(i + k) % 5] * (1 + k % 3) for k in range(3 + i % 7)]) for i in range(60)]
    path.write_text("\n\n".join(paras) + "\n")
    return path


def test_text_pack_rows(tmp_path):
    text = write_text(tmp_path / "t.txt")
    cfg = {"path": str(text), "block_size": 16, "batch_size": 4, "eval_lengths": [16], "pack": True}
    dm = TextDataModule({**cfg, "cache_dir": str(tmp_path / "cache")}, "decoder", 0)
    batch = next(iter(dm.train_dataloader()))
    check_packed_batch(batch)
    seg, labels, ids = batch["segment_ids"], batch["labels"], batch["input_ids"]
    same = seg[:, 1:] == seg[:, :-1]
    assert torch.equal(labels[:, :-1][same], ids[:, 1:][same])  # next token inside a document
    assert (labels[:, :-1][~same] == IGNORE_INDEX).all()  # never the next document's first token
    docs = [dm.tokenizer.encode(d).tolist() for d in text.read_text().split("\n\n") if d.strip()]
    second = ids[0][seg[0] == 1].tolist()  # starts in the row: the start of a document
    assert any(doc[: len(second)] == second for doc in docs)
    assert "segment_ids" not in next(iter(dm.val_dataloader()))


# --------------------------------------------------------------------------------------------- config
@pytest.fixture
def hydra_configs():
    with initialize_config_module("posformer.configs", version_base="1.3"):
        yield


def make(overrides: list[str]):
    return compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides])


def test_config_validates_pack(hydra_configs):
    read_train(make(["data.pack=true"]))
    with pytest.raises(Exception) as refused:  # data.pack is typed: refused while Hydra composes
        make(["data.pack=maybe"])
    assert (
        str(composition_error(refused.value, ["data.pack=maybe"]))
        == "data.pack='maybe' must be true or false."
    )
    with pytest.raises(ConfigError, match=r"data\.pack=true packs decoder-only rows, but model\.kind"):
        read_train(make(["model=encdec_tiny", "data.pack=true"]))
    with pytest.raises(ConfigError, match=r"positions\.randomized=false or data\.pack=false"):
        read_train(make(["data.pack=true", "positions.randomized=true", "positions.n_max=64"]))


# ---------------------------------------------------------------------------------------- end to end
#: a 1-layer d_model 16 model, 4 steps, no loggers (conftest's tiny run, without its data overrides)
TINY = [*TINY_MODEL, *TINY_TRAINING, *QUIET, "callbacks.model_checkpoint.monitor=null"]
TINY_TASK = ["data.n_train=64", "data.n_val=16", "data.batch_size=16", "data.train_len=[1,4]"]


def tiny_run(tmp_path: Path, extra: list[str]) -> dict:
    from posformer.cli.train import run

    overrides = [
        *TINY,
        "evaluate=false",
        "torch_threads=1",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
        "data.pack=true",
        *extra,
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return run(cfg)


@pytest.mark.parametrize("pe", ["alibi", "rope"])
def test_tiny_training_run_synthetic_packed(pe, tmp_path):
    results = tiny_run(tmp_path, [*TINY_TASK, f"pe={pe}"])
    assert results["global_step"] == 4 and results["data"]["pack"] is True
    assert math.isfinite(results["train"]["train/loss"])


def test_tiny_training_run_text_packed(tmp_path):
    text = write_text(tmp_path / "t.txt")
    extra = [
        "data=text",
        f"data.path={text}",
        "data.block_size=16",
        "data.batch_size=4",
        "data.eval_lengths=[16]",
    ]
    results = tiny_run(tmp_path, extra)
    assert results["global_step"] == 4 and results["data"]["pack"] is True
    assert math.isfinite(results["train"]["train/loss"])


def test_language_model_module_passes_segment_ids():
    from posformer.lit.modules import LanguageModelModule

    torch.manual_seed(0)
    module = LanguageModelModule(
        {
            "kind": "decoder",
            "vocab_size": 13,
            "d_model": 16,
            "n_heads": 2,
            "n_layers": 1,
            "d_ff": 32,
            "dropout": 0.0,
            "pe": "rope",
        }
    ).eval()
    ids, seg = packed_inputs()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}
    with torch.no_grad():
        packed = module.logits({**batch, "segment_ids": seg})
        torch.testing.assert_close(packed, module.model(ids, segment_ids=seg), atol=0, rtol=0)
        assert not torch.allclose(packed, module.logits(batch))  # without segments: one long document


OFFSET_BIAS_PES = [
    p for p in posformer.list_encodings() if isinstance(posformer.pe.ENCODINGS[p].capabilities.bias, Offsets)
]


@pytest.mark.parametrize("pe", OFFSET_BIAS_PES)
def test_packed_offset_bias_comes_from_the_offset_vector(pe, tiny_model, decoder_batch, monkeypatch):
    """At the model's own (restarting) positions, an offset-only bias of packed rows is read from the
    offset vector, with nothing read on the host (DPB's table would read the distances' range); the
    logits and every gradient equal those of the same positions given by the caller, whose bias the
    PE computes from the positions."""
    from posformer.model.context import AttentionContext

    built: list[int] = []
    build = AttentionContext._build_offset_vector
    monkeypatch.setattr(
        AttentionContext,
        "_build_offset_vector",
        lambda self, layer: built.append(layer) or build(self, layer),
    )
    model = tiny_model(pe).train()
    ids, _, _, _, seg = decoder_batch("packed")
    runs = []
    for positions in (document_positions(seg), None):  # given (the PE's bias of positions), then made
        model.zero_grad()
        out = model(ids, positions=positions, segment_ids=seg)
        out.float().logsumexp(-1).mean().backward()
        runs.append(
            (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
        assert bool(built) == (positions is None)
    (given, given_grads), (made, made_grads) = runs
    torch.testing.assert_close(made, given, atol=1e-5, rtol=1e-5)
    assert made_grads.keys() == given_grads.keys()
    for name, grad in made_grads.items():
        torch.testing.assert_close(grad, given_grads[name], atol=1e-5, rtol=1e-5, msg=name)

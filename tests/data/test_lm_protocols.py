"""The field's LM protocols as experiments (configs/experiment/lm_enwik8.yaml, lm_wikitext103.yaml) and
evaluation windows kept inside long documents (data.eval_windows=documents), on data generated here."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import posformer
from posformer.api import compose
from posformer.configs.settings import read_train
from tests.cli_cases import QUIET, TINY_MODEL

WORDS = ("river", "stone", "garden", "window", "horse", "lamp", "city", "sailor", "forest", "letter", "song")
TINY_RUN = [*TINY_MODEL, *QUIET, "trainer=cpu", "trainer.max_steps=2", "trainer.val_check_interval=2"]
TINY_RUN += ["callbacks.model_checkpoint.monitor=null", "torch_threads=1", "data.batch_size=2"]


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 14))).capitalize() + ".\n" for _ in range(n)]


def test_both_protocols_compose_with_their_lengths(tmp_path):
    paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/run"]
    enwik8 = compose("train", ["experiment=lm_enwik8", f"data.path={tmp_path}/enwik8", *paths])
    read_train(enwik8)
    assert (enwik8.data.tokenizer, enwik8.data.block_size) == ("byte", 256)
    assert (
        list(enwik8.data.eval_lengths) == [256, 512, 1024, 2048, 4096]
        and enwik8.data.max_tokens == 90_000_000
    )
    assert (enwik8.model.d_model, enwik8.model.n_layers, enwik8.model.n_heads) == (512, 6, 8)
    wikitext = compose("train", ["experiment=lm_wikitext103", *paths])
    read_train(wikitext)
    assert (wikitext.data.name, wikitext.data.dataset, wikitext.data.config) == (
        "hub",
        "wikitext",
        "wikitext-103-raw-v1",
    )
    assert wikitext.data.block_size == 512 and list(wikitext.data.eval_lengths) == [512, 1024, 2048]


@pytest.mark.slow  # a training run and its evaluation at 256-4096
def test_the_enwik8_protocol_runs_on_generated_bytes(tmp_path):
    text = tmp_path / "enwik8"
    text.write_text("".join(sentences(6000)), encoding="utf-8")  # ~400 kB: 5% validates, 20 kB
    result = posformer.train(
        ["experiment=lm_enwik8", f"data.path={text}", *TINY_RUN, f"paths.cache_dir={tmp_path / 'cache'}"],
        run_dir=tmp_path / "run",
    )
    assert sorted(result.metrics) == [256, 512, 1024, 2048, 4096]
    scored = {length: m["n_tokens"] for length, m in result.metrics.items()}
    assert len(set(scored.values())) == 1 and scored[4096] >= 4096  # the same tokens at every length
    assert result.results["data"]["tokenizer"] == "byte"


@pytest.mark.slow  # a training run and posformer-eval over non-overlapping and sliding windows
def test_the_wikitext103_protocol_runs_on_a_generated_wikitext(tmp_path):
    rows = {
        s: [{"text": t} for t in sentences(n, seed)]
        for s, n, seed in (("train", 2500, 0), ("validation", 600, 1))
    }
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows.items()}).save_to_disk(
        str(tmp_path / "wt")
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([r["text"] for r in rows["train"]], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    overrides = ["experiment=lm_wikitext103", f"data.dataset={tmp_path / 'wt'}", "data.config=null"]
    overrides += [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.num_proc=1", *TINY_RUN]
    result = posformer.train([*overrides, f"paths.cache_dir={tmp_path / 'cache'}"], run_dir=tmp_path / "run")
    assert sorted(result.metrics) == [512, 1024, 2048]
    ev = posformer.evaluate(
        tmp_path / "run",
        which="last",
        lengths=[512, 1024, 2048],
        output_dir=tmp_path / "ev",
        modes=["nonoverlap", "sliding"],
        stride=256,
    )
    rows_ok = {(r["mode"], r["length"]): r["status"] for r in ev.rows}
    assert rows_ok == {(m, L): "ok" for m in ("nonoverlap", "sliding") for L in (512, 1024, 2048)}


@pytest.mark.slow  # a training run and an evaluation at 32,768 tokens
def test_evaluation_windows_stay_inside_documents_up_to_32k(tmp_path):
    # 40 documents; every tenth validates (9, 19, 29, 39): long ones (~50,000 characters) there and at every
    # third, short ones (~1,300) between
    docs = ["".join(sentences(800 if i % 10 == 9 or i % 3 == 0 else 20, i)) for i in range(40)]
    datasets.Dataset.from_list([{"text": d} for d in docs]).save_to_disk(str(tmp_path / "books"))
    overrides = [
        "data=hub",
        f"data.dataset={tmp_path / 'books'}",
        "data.tokenizer=byte",
        "data.block_size=16",
    ]
    overrides += ["data.eval_lengths=[16,1024]", "data.eval_windows=documents", *TINY_RUN]
    result = posformer.train([*overrides, f"paths.cache_dir={tmp_path / 'cache'}"], run_dir=tmp_path / "run")
    assert result.metrics[1024]["n_tokens"] > 0
    ev = posformer.evaluate(
        tmp_path / "run",
        which="last",
        lengths=[4096, 32768, 65536],
        output_dir=tmp_path / "ev",
        modes=["nonoverlap"],
        n_tokens=32768,
        batch_tokens=32768,
    )
    by_length = {r["length"]: r for r in ev.rows}
    assert by_length[32768]["status"] == "ok" and by_length[32768]["scored_tokens"] == 32768
    assert by_length[4096]["scored_tokens"] == 32768  # 8 windows of 4,096 inside the long documents
    assert by_length[65536]["status"] == "too_long" and "no validation document" in by_length[65536]["reason"]

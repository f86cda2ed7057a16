"""Data layer: synthetic task semantics, the batch contract, determinism/caching, LM text pipeline, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from posformer.data import DATASETS, build_datamodule, register_dataset
from posformer.data.base import ResumableSampler
from posformer.data.synthetic import TASKS, generate_examples, task_vocab
from posformer.data.tokenizers import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, SEP_ID
from posformer.errors import ConfigError, DataError

SHAKESPEARE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt"
OPTS = {"symbols": 16, "reverse_answer": True, "reverse_operands": False, "key_len": 5}


def _examples(task: str, n: int = 40, lo: int = 1, hi: int = 12, **opts) -> list[dict]:
    params = json.dumps({**OPTS, **opts})
    return list(generate_examples(task, n, lo, hi, 0, "train", params, "test"))


def _syn(tmp_path: Path, kind: str = "decoder", run_seed: int = 0, **cfg) -> object:
    base = {"name": "synthetic", "n_train": 256, "n_val": 64, "n_eval_per_length": 32, "batch_size": 16}
    base.update(cfg)
    base.setdefault("cache_dir", str(tmp_path / "cache"))
    return build_datamodule(base, kind, run_seed)


def _digits(ids: list[int]) -> str:
    return "".join(str(i - 4) for i in ids)


# ------------------------------------------------------------------------------------------ semantics
def test_copy_reverse_sort_semantics():
    for ex in _examples("copy"):
        assert ex["answer"] == ex["prompt"] and len(ex["prompt"]) == ex["n"]
    for ex in _examples("reverse"):
        assert ex["answer"] == ex["prompt"][::-1] and len(ex["prompt"]) == ex["n"]
    for ex in _examples("sort"):
        assert ex["answer"] == sorted(ex["prompt"]) and len(ex["prompt"]) == ex["n"]
    for ex in _examples("copy", symbols=3):
        assert all(4 <= t < 7 for t in ex["prompt"])


@pytest.mark.parametrize("rev_ans,rev_ops", [(True, False), (False, False), (True, True)])
def test_addition_is_correct(rev_ans, rev_ops):
    plus = 4 + 10
    for ex in _examples("addition", hi=20, reverse_answer=rev_ans, reverse_operands=rev_ops):
        n, prompt, ans = ex["n"], ex["prompt"], ex["answer"]
        assert len(prompt) == 2 * n + 1 and prompt[n] == plus and len(ans) == n + 1
        a, b, s = _digits(prompt[:n]), _digits(prompt[n + 1 :]), _digits(ans)
        if rev_ops:
            a, b = a[::-1], b[::-1]
        if rev_ans:
            s = s[::-1]
        assert int(a) + int(b) == int(s)


def test_recall_and_passkey_semantics():
    for ex in _examples("recall", hi=16):
        pairs, query = ex["prompt"][:-1], ex["prompt"][-1]
        keys, values = pairs[0::2], pairs[1::2]
        assert len(keys) == ex["n"] and len(set(keys)) == len(keys)
        assert ex["answer"] == [values[keys.index(query)]]
    key_mark = 4 + 10
    for ex in _examples("passkey", hi=30, key_len=3):
        p = ex["prompt"]
        assert p.count(key_mark) == 1 and len(p) == ex["n"] + 1 + 3
        at = p.index(key_mark)
        assert ex["answer"] == p[at + 1 : at + 4] and all(4 <= d < 14 for d in ex["answer"])
    ruler = {"multikey", "multivalue", "vartrack"}  # posformer.data.ruler (tests/data/test_ruler.py)
    assert (
        set(TASKS) == {"copy", "reverse", "sort", "addition", "recall", "passkey", "indirect_index"} | ruler
    )


# ---------------------------------------------------------------------------------------- contract
def _check_decoder_batch(batch: dict, rows: list[dict], bos: bool = False) -> None:
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.dtype == labels.dtype == torch.long and mask.dtype == torch.bool
    assert ids.shape == labels.shape == mask.shape
    for i, r in enumerate(rows):
        full = ([BOS_ID] if bos else []) + r["prompt"] + [SEP_ID] + r["answer"] + [EOS_ID]
        m = len(full) - 1
        assert ids[i, :m].tolist() == full[:-1] and mask[i, :m].all() and not mask[i, m:].any()
        assert (ids[i, m:] == PAD_ID).all()
        scored = labels[i] != IGNORE_INDEX
        assert labels[i][scored].tolist() == r["answer"] + [EOS_ID]  # loss on answer + EOS only
        first = int(scored.nonzero()[0])
        assert ids[i, first] == SEP_ID  # the output at SEP predicts the first answer token
        # shifted: labels[t] is the token at t + 1 where both are real
        assert labels[i, first : m - 1].tolist() == ids[i, first + 1 : m].tolist()


def test_decoder_batch_contract(tmp_path):
    dm = _syn(tmp_path, task="reverse", train_len=[1, 8])
    loader = dm.val_dataloader()
    batch = next(iter(loader))
    _check_decoder_batch(batch, [dm.val_dataset()[i] for i in range(len(batch["input_ids"]))])
    assert dm.task_type == "task" and dm.pad_id == PAD_ID and dm.vocab_size == 4 + 16
    assert batch["input_ids"].shape[1] == max(2 * r["n"] + 1 for r in dm.val_dataset().select(range(16)))
    dm_bos = _syn(tmp_path, task="copy", bos=True, train_len=[2, 5])
    batch = next(iter(dm_bos.val_dataloader()))
    _check_decoder_batch(batch, [dm_bos.val_dataset()[i] for i in range(len(batch["input_ids"]))], bos=True)
    assert (batch["input_ids"][:, 0] == BOS_ID).all()


def test_encoder_decoder_batch_contract(tmp_path):
    dm = _syn(tmp_path, "encoder_decoder", task="sort", train_len=[1, 8])
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"src_ids", "src_mask", "tgt_ids", "tgt_mask", "labels"}
    for i in range(len(batch["src_ids"])):
        r = dm.val_dataset()[i]
        s, t = len(r["prompt"]) + 1, len(r["answer"]) + 1
        assert batch["src_ids"][i, :s].tolist() == r["prompt"] + [EOS_ID]
        assert batch["src_mask"][i].sum() == s and (batch["src_ids"][i, s:] == PAD_ID).all()
        assert batch["tgt_ids"][i, :t].tolist() == [BOS_ID] + r["answer"]
        assert batch["labels"][i, :t].tolist() == r["answer"] + [EOS_ID]
        assert (batch["labels"][i, t:] == IGNORE_INDEX).all() and batch["tgt_mask"][i].sum() == t


def test_eval_dataloaders_by_length(tmp_path):
    dm = _syn(tmp_path, task="copy", train_len=[1, 8], eval_lengths=[4, 8, 32])
    assert dm.train_length == 8
    loaders = dm.eval_dataloaders()
    assert list(loaders) == [4, 8, 32]
    for length, loader in loaders.items():
        assert all(n == length for n in loader.dataset["n"]) and len(loader.dataset) == 32
        batch = next(iter(loader))
        assert batch["input_ids"].shape[1] == 2 * length + 1
    assert loaders[32].batch_size < loaders[8].batch_size  # same tokens per batch at long lengths
    assert list(dm.eval_dataloaders([16])) == [16]
    summary = dm.config_summary()
    assert summary["task"] == "copy" and summary["train_length"] == 8 and summary["vocab_size"] == 20
    assert "<sep>" in dm.decode(next(iter(loaders[4]))["input_ids"][0])


# ------------------------------------------------------------------------- determinism, cache, resume
def test_determinism_and_cache_key(tmp_path):
    a = _syn(tmp_path, task="reverse").train_dataset()
    b = _syn(tmp_path, task="reverse").train_dataset()
    assert a["prompt"] == b["prompt"] and a.cache_files == b.cache_files  # same params: cached, identical
    fresh = _syn(tmp_path, task="reverse", cache_dir=str(tmp_path / "other")).train_dataset()
    assert fresh["prompt"] == a["prompt"]  # regenerated from scratch: identical
    for change in ({"symbols": 8}, {"seed": 1}, {"train_len": [1, 15]}):
        c = _syn(tmp_path, task="reverse", **change).train_dataset()
        assert c.cache_files != a.cache_files and c["prompt"] != a["prompt"], change
    fewer = _syn(tmp_path, task="reverse", n_train=255).train_dataset()
    assert fewer.cache_files != a.cache_files and fewer["prompt"] == a["prompt"][:255]  # a prefix
    add1 = _syn(tmp_path, task="addition").train_dataset()
    add2 = _syn(tmp_path, task="addition", reverse_answer=False).train_dataset()
    assert add1["prompt"] == add2["prompt"] and add1["answer"] != add2["answer"]
    dm = _syn(tmp_path, task="reverse")
    assert dm.val_dataset()["prompt"][:10] != dm.train_dataset()["prompt"][:10]  # independent streams


def test_sampler_order_is_pure_and_resumable(tmp_path):
    s = ResumableSampler(50, seed=3)
    e0 = list(s)
    assert e0 == list(ResumableSampler(50, seed=3)) and sorted(e0) == list(range(50))
    s.set_epoch(1)
    assert list(s) != e0 and list(ResumableSampler(50, seed=4)) != e0
    dm = _syn(tmp_path, task="copy", seed=0)
    full = [b["input_ids"] for b in dm.train_dataloader()]
    dm.set_position(0, 5)
    rest = list(dm.train_dataloader())
    assert len(rest) == len(full) - 5
    assert all(torch.equal(x["input_ids"], y) for x, y in zip(rest, full[5:]))
    again = list(dm.train_dataloader())  # the skip applies once
    assert len(again) == len(full) and torch.equal(again[0]["input_ids"], full[0])
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = dm.train_dataloader()
    _set_sampler_epoch(loader, 1)  # what Lightning does at every epoch start
    epoch1 = next(iter(loader))["input_ids"]
    assert not torch.equal(epoch1, full[0])
    dm.set_position(1, 0)
    assert torch.equal(next(iter(dm.train_dataloader()))["input_ids"], epoch1)
    other_seed = _syn(tmp_path, task="copy", run_seed=1, seed=0)  # data seed fixed, run seed 1
    assert other_seed.train_dataset()["prompt"] == dm.train_dataset()["prompt"]
    assert not torch.equal(next(iter(other_seed.train_dataloader()))["input_ids"], full[0])


# ------------------------------------------------------------------------------------------- text
@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "über", "naïve", "dog", "ran", "far", "away", "—"]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 12))) + "\n" for _ in range(600)]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _text(path, tmp_path, **cfg):
    base = {"name": "text", "path": str(path), "block_size": 32, "batch_size": 8, "cache_dir": str(tmp_path)}
    base.update(cfg)
    return build_datamodule(base, "decoder", 0)


@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe"])
def test_text_lm_tokenizers(text_file, tmp_path, tokenizer):
    dm = _text(text_file, tmp_path, tokenizer=tokenizer, vocab_size=300, eval_lengths=[16, 32, 64])
    text = text_file.read_text(encoding="utf-8")
    assert dm.task_type == "lm" and dm.train_length == 32 and dm.pad_id == 0
    both = np.concatenate([dm.train_stream, dm.val_stream])
    assert dm.decode(both) == text  # lossless, and the split keeps every character
    assert len(dm.val_stream) / len(both) == pytest.approx(0.1, abs=0.03)
    assert dm.vocab_size == {"byte": 260, "bpe": 300}.get(tokenizer, 5 + len(set(text)))
    assert int(both.max()) < dm.vocab_size and int(both.min()) >= 4
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 32) and batch["attention_mask"].all()
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    # cached: a second build loads the same streams from the same place
    again = _text(text_file, tmp_path, tokenizer=tokenizer, vocab_size=300, block_size=16)
    assert again.cache_path == dm.cache_path and np.array_equal(again.train_stream, dm.train_stream)
    assert dm.config_summary()["tokenizer"] == tokenizer


def test_text_eval_chunks_score_same_tokens(text_file, tmp_path):
    dm = _text(text_file, tmp_path, tokenizer="byte", eval_tokens=512)
    loaders = dm.eval_dataloaders([16, 32, 64, 128])
    scored = {}
    for length, loader in loaders.items():
        batches = list(loader)
        assert all(b["input_ids"].shape[1] == length for b in batches)
        scored[length] = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert set(scored.values()) == {512}
    chunks = dm.eval_chunks(64, 256)
    assert len(chunks) == 4
    assert np.array_equal(chunks[1][:-1], np.asarray(dm.val_stream[64:128]))  # non-overlapping
    val = list(dm.val_dataloader())
    assert sum(len(b["input_ids"]) for b in val) == (len(dm.val_stream) - 1) // 32


def test_text_cache_key_tracks_file_and_options(text_file, tmp_path):
    a = _text(text_file, tmp_path, tokenizer="char")
    b = _text(text_file, tmp_path, tokenizer="char", val_fraction=0.2)
    c = _text(text_file, tmp_path, tokenizer="byte")
    assert len({a.cache_path, b.cache_path, c.cache_path}) == 3
    copy = tmp_path / "copy.txt"
    copy.write_text(text_file.read_text(encoding="utf-8") + "more text here\n", encoding="utf-8")
    d = _text(copy, tmp_path, tokenizer="char")
    copy.write_text(text_file.read_text(encoding="utf-8") + "changed text!!\n", encoding="utf-8")
    e = _text(copy, tmp_path, tokenizer="char")
    assert d.cache_path != e.cache_path and not np.array_equal(d.val_stream, e.val_stream)


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="tinyshakespeare not available")
def test_tinyshakespeare_char(tmp_path):
    cfg = {"name": "text", "path": str(SHAKESPEARE), "tokenizer": "char", "cache_dir": str(tmp_path)}
    dm = build_datamodule(cfg, "decoder", 0)
    assert dm.vocab_size == 5 + 65 and dm.block_size == 256
    assert dm.decode(dm.train_stream[:14]) == "First Citizen:"
    loaders = dm.eval_dataloaders([128, 512])
    assert next(iter(loaders[512]))["input_ids"].shape[1] == 512


# ------------------------------------------------------------------------------------------ errors
def test_text_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt.*not found.*data\.path="):
        _text(tmp_path / "nope.txt", tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        _text(empty, tmp_path)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"hello world\n" * 20 + "caf\xe9\n".encode("latin-1") + b"more text\n" * 20)
    with pytest.raises(DataError, match=r"offset 243.*encoding_errors=replace"):
        _text(bad, tmp_path)
    with pytest.warns(UserWarning, match="offset 243"):
        dm = _text(bad, tmp_path, encoding_errors="replace", block_size=8, tokenizer="char")
    assert "\ufffd" in dm.tokenizer.chars
    with pytest.raises(ConfigError, match="data.path"):
        build_datamodule({"name": "text", "path": None}, "decoder", 0)
    with pytest.raises(ConfigError, match="decoder"):
        build_datamodule({"name": "text", "path": str(bad)}, "encoder_decoder", 0)
    with pytest.raises(ConfigError, match="tokenizer='chars' is unknown; did you mean char.*char, byte, bpe"):
        _text(bad, tmp_path, tokenizer="chars")
    with pytest.raises(DataError, match="tokenizer='word' is not char, byte or bpe.*offline, and not cached"):
        _text(bad, tmp_path, tokenizer="word")
    small = tmp_path / "small.txt"
    small.write_text("tiny text\n", encoding="utf-8")
    with pytest.raises(DataError, match="block_size"):
        _text(small, tmp_path)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="copy, reverse, sort, addition, recall, passkey"):
        _syn(tmp_path, task="shuffle")
    with pytest.raises(ConfigError, match=r"train_len\[0\]=0"):
        _syn(tmp_path, train_len=[0, 8])
    with pytest.raises(ConfigError, match=r"min 9 is greater than max 4"):
        _syn(tmp_path, train_len=[9, 4])
    with pytest.raises(ConfigError, match="batch_size=0"):
        _syn(tmp_path, batch_size=0)
    with pytest.raises(ConfigError, match="batch_size=-4"):
        _syn(tmp_path, batch_size=-4)
    with pytest.raises(ConfigError, match=r"eval_lengths=\[8, -1\] contains non-positive lengths \[-1\]"):
        _syn(tmp_path, eval_lengths=[8, -1])
    with pytest.raises(ConfigError, match="symbols>=32"):
        _syn(tmp_path, task="recall", symbols=16, eval_lengths=[32])
    with pytest.raises(
        ConfigError, match=r"data\.trian_len is not a data setting .*did you mean data\.train_len"
    ):
        _syn(tmp_path, trian_len=[1, 2])
    with pytest.raises(ConfigError, match="model kind 'encoder'"):
        _syn(tmp_path, "encoder")
    with pytest.raises(ConfigError, match="data.name='nosuch'.*synthetic"):
        build_datamodule({"name": "nosuch"}, "decoder", 0)
    with pytest.raises(ConfigError, match="valid tasks"):
        task_vocab("nosuch", OPTS)


def test_omegaconf_config_and_registry(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "data" / "synthetic.yaml")
    cfg.pop("defaults")  # Hydra's: the file starts with its schema node (/schema/data/synthetic)
    root = OmegaConf.create({"seed": 7, "paths": {"cache_dir": str(tmp_path)}, "data": cfg})
    root.data.n_train = 64
    dm = build_datamodule(root.data, "decoder", 7)
    assert dm.data_seed == 7 and dm.config_summary()["task"] == cfg.task
    missing = OmegaConf.create({"name": "text", "path": "???"})
    with pytest.raises(ConfigError, match="path"):
        build_datamodule(missing, "decoder", 0)
    calls = []
    register_dataset("dummy_test", lambda c, k, s: calls.append((c, k, s)) or "built")
    try:
        assert build_datamodule({"name": "dummy_test", "x": 1}, "decoder", 3) == "built"
        assert calls == [({"name": "dummy_test", "x": 1}, "decoder", 3)]
        with pytest.raises(ConfigError, match="already registered"):
            register_dataset("dummy_test", lambda c, k, s: None)
    finally:
        DATASETS.pop("dummy_test")


def test_hub_offline_is_fast_and_clear(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    import posformer.data.hub as text_mod  # hub_offline / hub_reachable live there

    cfg = {"name": "hub", "dataset": "wikitext", "config": "wikitext-103-raw-v1", "cache_dir": str(tmp_path)}
    monkeypatch.setattr(text_mod, "hub_offline", lambda: False)
    monkeypatch.setattr(text_mod, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(DataError, match="hub is unreachable.*HF_HUB_OFFLINE=1.*data=text data.path="):
        build_datamodule(cfg, "decoder", 0)
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="wikitext.*unreachable.*offline mode.*data=text"):
        build_datamodule(cfg, "decoder", 0)
    with pytest.raises(ConfigError, match="data.dataset=wikitext"):
        build_datamodule({"name": "hub"}, "decoder", 0)


@pytest.mark.parametrize(
    "preset,task",
    [
        ("synthetic", None),
        ("copy", "copy"),
        ("addition", "addition"),
        ("recall", "recall"),
        ("passkey", "passkey"),
        ("sort", "sort"),
    ],
)
def test_hydra_presets_compose_and_build(tmp_path, preset, task):
    from hydra import compose, initialize_config_module

    overrides = [f"data={preset}", f"data.cache_dir={tmp_path}", "data.n_train=32", "data.n_val=8", "seed=3"]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    dm = build_datamodule(cfg.data, "decoder", int(cfg.seed))
    assert dm.task == (task or cfg.data.task) and dm.data_seed == 3
    assert dm.train_length == cfg.data.train_len[1] and dm.eval_lengths == sorted(cfg.data.eval_lengths)
    assert len(dm.train_dataset()) == 32


def test_hub_pipeline_on_a_local_dataset_dir(tmp_path):
    """data=hub runs the same LM pipeline; a local dataset directory needs no network."""
    root = tmp_path / "ds"
    root.mkdir()
    (root / "train.txt").write_text("".join(f"training line {i}\n" for i in range(200)), encoding="utf-8")
    (root / "validation.txt").write_text("".join(f"held out {i}\n" for i in range(50)), encoding="utf-8")
    cfg = {
        "name": "hub",
        "dataset": str(root),
        "tokenizer": "byte",
        "block_size": 16,
        "cache_dir": str(tmp_path),
    }
    dm = build_datamodule(cfg, "decoder", 0)
    assert dm.task_type == "lm" and dm.decode(dm.val_stream[:11]) == "held out 0\n"
    assert dm.decode(dm.train_stream[:16]) == "training line 0\n"
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (32, 16)
    with pytest.raises(ConfigError, match="text_column='body'.*columns: \\['text'\\]"):
        build_datamodule({**cfg, "text_column": "body"}, "decoder", 0)


def test_worker_processes_give_the_same_batches(tmp_path, text_file):
    a = _syn(tmp_path, task="addition", n_train=64)
    b = _syn(tmp_path, task="addition", n_train=64, num_workers=1)
    for x, y in zip(a.train_dataloader(), b.train_dataloader(), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    t = _text(text_file, tmp_path, tokenizer="byte", num_workers=1)
    first = next(iter(t.train_dataloader()))
    assert torch.equal(
        first["input_ids"],
        next(iter(_text(text_file, tmp_path, tokenizer="byte").train_dataloader()))["input_ids"],
    )


def test_batches_are_pinned_only_for_a_cuda_trainer(tmp_path):
    """Page-locked batches (an asynchronous copy to the GPU) when the attached trainer runs on CUDA;
    none without a trainer (evaluation) or on the CPU (pinning needs CUDA)."""
    from types import SimpleNamespace

    dm = _syn(tmp_path, task="copy")
    assert not dm.train_dataloader().pin_memory and not dm.val_dataloader().pin_memory
    for device, pinned in (("cpu", False), ("cuda", True)):
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
        assert dm.train_dataloader().pin_memory is pinned and dm.val_dataloader().pin_memory is pinned
        assert all(loader.pin_memory is pinned for loader in dm.eval_dataloaders().values())

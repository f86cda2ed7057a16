"""Translation pipeline: parallel data + joint BPE + token batching, sacreBLEU scoring, checkpoint
averaging, run_translate end to end, the paper's base/big configurations."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import lightning
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from posformer.checkpoints import last_checkpoints
from posformer.data import BOS_ID, EOS_ID, PAD_ID, build_datamodule
from posformer.data.translation import read_parallel, token_batches
from posformer.errors import CheckpointError, ConfigError, DataError
from posformer.eval.averaging import average_checkpoints
from posformer.eval.translate import run_translate, score_translations
from posformer.lit import Seq2SeqModule
from posformer.model import ModelConfig, build_model

MULTI30K = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"

WORDS_DE = [
    "der",
    "die",
    "das",
    "Hund",
    "Katze",
    "läuft",
    "schnell",
    "über",
    "Straße",
    "Mann",
    "Frau",
    "sieht",
    "einen",
    "großen",
    "kleinen",
    "Ball",
]
WORDS_EN = [
    "the",
    "the",
    "the",
    "dog",
    "cat",
    "runs",
    "fast",
    "across",
    "street",
    "man",
    "woman",
    "sees",
    "a",
    "big",
    "small",
    "ball",
]


def _corpus(directory: Path, n_train: int = 160, gz: bool = True) -> Path:
    """Toy German/English corpus: word-by-word 'translations' of random sentences."""
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", 20), ("test", 12)):
        de, en = [], []
        for _ in range(n):
            idx = [rng.randrange(len(WORDS_DE)) for _ in range(rng.randint(2, 9))]
            de.append(" ".join(WORDS_DE[i] for i in idx) + ".")
            en.append((" ".join(WORDS_EN[i] for i in idx) + ".").capitalize())
        for lang, lines in (("de", de), ("en", en)):
            text = "\n".join(lines) + "\n"
            if gz:
                with gzip.open(directory / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                    f.write(text)
            else:
                (directory / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return directory


def _data_cfg(path: Path, cache: Path | None, **kw) -> dict:
    cfg = {
        "name": "translation",
        "path": str(path),
        "splits": {"train": "train", "val": "val", "test": "test"},
        "vocab_size": 300,
        "min_frequency": 1,
        "max_tokens": 64,
        "max_len": 32,
        "cache_dir": str(cache) if cache else None,
    }
    cfg.update(kw)
    return cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def dm(corpus, tmp_path_factory):
    return build_datamodule(_data_cfg(corpus, tmp_path_factory.mktemp("cache")), "encoder_decoder", 0)


# ------------------------------------------------------------------------------------------- data
def test_read_parallel_plain_and_gz(tmp_path):
    _corpus(tmp_path / "plain", gz=False)
    _corpus(tmp_path / "gz", gz=True)
    a = read_parallel(tmp_path / "plain" / "train.de", tmp_path / "plain" / "train.en")
    b = read_parallel(tmp_path / "gz" / "train.de.gz", tmp_path / "gz" / "train.en.gz")
    assert a == b and len(a[0]) == 160 and a[0][0].endswith(".")


def test_misaligned_and_missing_files(tmp_path):
    (tmp_path / "a.de").write_text("eins\nzwei\ndrei\n")
    (tmp_path / "a.en").write_text("one\ntwo\n")
    with pytest.raises(DataError, match=r"a\.de.*3 lines.*a\.en.*2"):
        read_parallel(tmp_path / "a.de", tmp_path / "a.en")
    with pytest.raises(DataError, match="does not exist"):
        read_parallel(tmp_path / "nope.de", tmp_path / "a.en")
    with pytest.raises(DataError, match=r"no file train\.de"):
        build_datamodule(_data_cfg(tmp_path, None), "encoder_decoder", 0)


def test_bad_config_is_rejected(corpus):
    with pytest.raises(ConfigError, match="not supported"):
        build_datamodule(_data_cfg(corpus, None), "decoder", 0)
    with pytest.raises(ConfigError, match="max_tokens"):
        build_datamodule(_data_cfg(corpus, None, max_tokens=8, max_len=16), "encoder_decoder", 0)
    with pytest.raises(ConfigError, match=r"data\.vocab is not a data setting.*data\.vocab_size"):
        build_datamodule(_data_cfg(corpus, None, vocab=3), "encoder_decoder", 0)


def test_hub_offline_is_a_clear_error(corpus, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read the variables once, at import (test_data may have imported them already)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    cfg = _data_cfg(
        corpus, None, source="hub", hub_name="posformer-test/definitely-not-here", hub_config="de-en"
    )
    with pytest.raises(DataError, match="could not load the Hugging Face dataset"):
        build_datamodule(cfg, "encoder_decoder", 0)


def test_bpe_roundtrip_and_shared_vocab(dm):
    assert dm.task_type == "translation" and dm.pad_id == PAD_ID
    assert 260 <= dm.vocab_size <= 300
    src, ref = dm.texts("test")
    for s in src + ref:
        assert dm.decode(dm.encode(s)) == s
    # one vocabulary trained on both sides: merges were learned from German and from English words
    assert len(dm.encode(" Katze")) < 6 and len(dm.encode(" cat")) < 4


def test_batch_contract(dm):
    batch = next(iter(dm.train_dataloader()))
    src, smask, tgt, tmask, labels = (
        batch[k] for k in ("src_ids", "src_mask", "tgt_ids", "tgt_mask", "labels")
    )
    assert src.dtype == tgt.dtype == labels.dtype == torch.long and smask.dtype == tmask.dtype == torch.bool
    assert tgt.shape == labels.shape == tmask.shape and src.shape == smask.shape
    assert (tgt[:, 0] == BOS_ID).all()
    assert torch.equal(smask, src != PAD_ID) and torch.equal(tmask, labels != -100)
    for b in range(src.shape[0]):
        n, m = int(smask[b].sum()), int(tmask[b].sum())
        assert src[b, n - 1] == EOS_ID and labels[b, m - 1] == EOS_ID
        assert torch.equal(tgt[b, 1:m], labels[b, : m - 1])  # labels = tgt shifted left
        assert (tgt[b, m:] == PAD_ID).all()
        i = int(batch["idx"][b])
        assert dm.decode(src[b]) == dm.texts("train")[0][i]
        assert dm.decode(labels[b].clamp(min=0)) == dm.texts("train")[1][i]


def test_token_batching_deterministic_and_complete(dm):
    loader = dm.train_dataloader()
    sampler = loader.batch_sampler
    epoch0 = [list(b) for b in sampler]
    again = [list(b) for b in dm.train_dataloader().batch_sampler]
    sampler.set_epoch(1)
    epoch1 = [list(b) for b in sampler]
    assert epoch0 == again and epoch0 != epoch1 and sorted(map(sorted, epoch0)) == sorted(map(sorted, epoch1))
    flat = sorted(i for b in epoch0 for i in b)
    assert flat == list(range(len(dm.train_dataset())))  # every pair once per epoch
    corpus = dm.train_dataset()
    for b in epoch0:
        if len(b) > 1:  # padded size within budget on both sides
            assert len(b) * corpus.src_lens[b].max() <= 64 and len(b) * corpus.tgt_lens[b].max() <= 64
    spread = np.mean([corpus.tgt_lens[b].max() - corpus.tgt_lens[b].min() for b in epoch0])
    assert spread <= 1.0  # grouped by length
    other = token_batches(corpus.src_lens, corpus.tgt_lens, 64, seed=1)
    assert sorted(map(sorted, other)) != sorted(map(sorted, epoch0))  # the seed changes batch composition


def test_tokenizer_cache(corpus, tmp_path):
    cache = tmp_path / "cache"
    a = build_datamodule(_data_cfg(corpus, cache), "encoder_decoder", 0)
    files = sorted(p.name for p in a.cache_path.iterdir())
    assert files == ["test", "tokenizer.json", "train", "val"]  # a token store per split, shards per side
    b = build_datamodule(_data_cfg(corpus, cache), "encoder_decoder", 0)
    assert b.cache_path == a.cache_path and b.tokenizer.to_str() == a.tokenizer.to_str()
    c = build_datamodule(_data_cfg(corpus, cache, vocab_size=280), "encoder_decoder", 0)
    assert c.cache_path != a.cache_path and c.vocab_size <= 280


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="Multi30k not present in ../shared/data")
def test_multi30k_files(tmp_path):
    cfg = _data_cfg(
        MULTI30K,
        tmp_path,
        splits={"train": "train", "val": "val", "test": "test_2016_flickr"},
        n_train=400,
        vocab_size=600,
        max_tokens=1024,
    )
    dm = build_datamodule(cfg, "encoder_decoder", 0)
    assert len(dm.corpora["val"]) == 1014 and len(dm.corpora["test"]) == 1000
    src, ref = dm.texts("test")
    assert src[0].startswith("Ein Mann") and ref[0].startswith("A man")
    assert all(dm.decode(dm.encode(s)) == s for s in src[:200])


# ------------------------------------------------------------------------------------------ scoring
def test_bleu_perfect_and_imperfect():
    refs = ["A man is riding a bike down the street.", "Two dogs play in the snow."]
    perfect = score_translations(refs, refs)
    assert perfect["bleu"] == 100.0 and perfect["chrf"] == 100.0
    assert "nrefs:1" in perfect["bleu_signature"] and "version" in perfect["bleu_signature"]
    worse = score_translations(["A man rides a bike.", "Two cats sleep."], refs)
    assert 0 < worse["bleu"] < 100 and worse["chrf"] < 100
    with pytest.raises(ConfigError, match="pair up"):
        score_translations(refs[:1], refs)


# ---------------------------------------------------------------------------------------- averaging
def _module(vocab: int, seed: int) -> Seq2SeqModule:
    torch.manual_seed(seed)
    model = dict(
        kind="encoder_decoder",
        vocab_size=vocab,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        pe="sinusoidal",
        share_src_tgt_embedding=True,
    )
    return Seq2SeqModule(model=model, data={"task_type": "translation"})


def _save(module: Seq2SeqModule, path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": lightning.__version__,
            "global_step": step,
            "epoch": 0,
            "optimizer_states": [{"state": {}}],
        },
        path,
    )
    return path


def test_average_checkpoints(tmp_path):
    mods = [_module(40, s) for s in range(3)]
    paths = [
        _save(m, tmp_path / "ck" / f"step{100 * (i + 1):06d}.ckpt", 100 * (i + 1)) for i, m in enumerate(mods)
    ]
    _save(mods[2], tmp_path / "ck" / "last.ckpt", 300)
    chosen = last_checkpoints(tmp_path / "ck", 2)
    assert [p.name for p in chosen] == ["step000200.ckpt", "step000300.ckpt"]
    chosen = last_checkpoints(tmp_path / "ck", 2, up_to_step=250)  # equal-step comparisons
    assert [p.name for p in chosen] == ["step000100.ckpt", "step000200.ckpt"]
    with pytest.raises(CheckpointError, match="at or before step 150"):
        last_checkpoints(tmp_path / "ck", 2, up_to_step=150)
    out = average_checkpoints(paths, tmp_path / "avg.ckpt")
    loaded = Seq2SeqModule.load_from_checkpoint(str(out), map_location="cpu")
    for name, p in loaded.state_dict().items():
        mean = sum(m.state_dict()[name].double() for m in mods) / 3
        assert torch.allclose(p.double(), mean, atol=1e-6), name
    raw = torch.load(out, weights_only=True)
    assert "optimizer_states" not in raw and raw["averaged_steps"] == [100, 200, 300]
    with pytest.raises(CheckpointError, match="shapes"):
        average_checkpoints(
            [paths[0], _save(_module(41, 0), tmp_path / "other.ckpt", 1)], tmp_path / "x.ckpt"
        )
    fewer = torch.load(paths[1], weights_only=True)
    fewer["state_dict"].pop("model.out_proj.weight")
    torch.save(fewer, tmp_path / "fewer.ckpt")
    with pytest.raises(CheckpointError, match="different parameters"):
        average_checkpoints([paths[0], tmp_path / "fewer.ckpt"], tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match="3 distinct"):
        last_checkpoints(tmp_path / "ck", 5)


# ------------------------------------------------------------------------------------ run_translate
def test_run_translate_end_to_end(corpus, dm, tmp_path):
    run = tmp_path / "run"
    data_cfg = _data_cfg(corpus, Path(dm.cache_path).parents[1])
    (run).mkdir()
    OmegaConf.save(OmegaConf.create({"seed": 0, "data": data_cfg}), run / "config.yaml")
    for i in range(2):
        _save(_module(dm.vocab_size, i), run / "checkpoints" / "periodic" / f"step{i + 1:06d}.ckpt", i + 1)
    out = tmp_path / "out"
    cfg = OmegaConf.create(
        {
            "eval": {
                "run_dir": str(run),
                "average_last": 2,
                "limit": 5,
                "max_len_b": 3,
                "output_dir": str(out),
                "progress": False,
            }
        }
    )
    res = run_translate(cfg)
    hyps = (out / "hyps.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == 5 and res["n_sentences"] == 5
    saved = json.loads((out / "scores.json").read_text())
    assert {"bleu", "chrf", "bleu_signature", "checkpoint", "averaged_from", "beam_size", "alpha"} <= set(
        saved
    )
    assert len(saved["averaged_from"]) == 2 and saved["beam_size"] == 4 and saved["alpha"] == 0.6
    assert (out / "averaged_last2.ckpt").is_file()
    with pytest.raises(ConfigError, match="eval.checkpoint"):
        run_translate(OmegaConf.create({"eval": {}}))
    wrong = _save(_module(dm.vocab_size + 5, 0), run / "checkpoints" / "wrong.ckpt", 9)
    with pytest.raises(CheckpointError, match="vocabulary"):
        run_translate(OmegaConf.create({"eval": {"checkpoint": str(wrong), "output_dir": str(out)}}))


# ------------------------------------------------------------------------------------ paper configs
def _compose(overrides: list[str]):
    with initialize_config_module("posformer.configs", version_base="1.3"):
        return compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides])


def paper_parameter_count(vocab: int, d: int, d_ff: int, n_layers: int = 6) -> int:
    """Shared (src = tgt = pre-softmax) embedding + post-LN layers with biases and LayerNorms."""
    ffn = 2 * d * d_ff + d_ff + d
    enc = (4 * d * d + 4 * d) + ffn + 2 * (2 * d)
    dec = 2 * (4 * d * d + 4 * d) + ffn + 3 * (2 * d)
    return vocab * d + n_layers * (enc + dec)


@pytest.mark.parametrize(
    "name, d, d_ff, heads, dropout", [("base", 512, 2048, 8, 0.1), ("big", 1024, 4096, 16, 0.3)]
)
def test_paper_configs(name, d, d_ff, heads, dropout):
    cfg = _compose([f"experiment=transformer_{name}"])
    m = cfg.model
    assert (m.d_model, m.d_ff, m.n_heads, m.dropout) == (d, d_ff, heads, dropout)
    assert (m.n_encoder_layers, m.n_decoder_layers, m.kind, m.pe) == (6, 6, "encoder_decoder", "sinusoidal")
    assert m.norm_first is False and m.scale_embedding and m.tie_embeddings and m.share_src_tgt_embedding
    assert m.activation == "relu" and cfg.loss.label_smoothing == 0.1 and cfg.data.vocab_size == 37000
    assert cfg.optim.name == "adam" and list(cfg.optim.betas) == [0.9, 0.98] and cfg.optim.eps == 1e-9
    assert cfg.schedule.name == "inverse_sqrt" and cfg.schedule.warmup_steps == 4000
    tokens = cfg.data.max_tokens * cfg.trainer.accumulate_grad_batches
    assert 24000 <= tokens <= 26000  # ~25k source and ~25k target tokens per step
    fields = {k: v for k, v in OmegaConf.to_container(m, resolve=True).items()}
    fields["vocab_size"] = 37000
    with torch.device("meta"):
        model = build_model(ModelConfig(**fields))
    expected = paper_parameter_count(37000, d, d_ff)
    assert model.num_parameters() == expected
    assert expected == {"base": 63_082_496, "big": 214_245_376}[name]  # paper: 65M / 213M


def test_multi30k_experiment_composes():
    cfg = _compose(["experiment=multi30k_de_en"])
    assert cfg.data.name == "translation" and cfg.data.src_lang == "de" and cfg.data.tgt_lang == "en"
    assert cfg.model.d_model == 256 and cfg.model.share_src_tgt_embedding
    assert cfg.callbacks.periodic_checkpoint.save_top_k == -1


def test_eval_buckets_by_source_length(dm):
    loaders = dm.eval_dataloaders([6, 9, 100])
    seen, lo = [], 0
    for hi, loader in loaders.items():
        for batch in loader:
            n = batch["src_mask"].sum(1)
            assert ((n > lo) & (n <= hi)).all()
            seen += batch["idx"].tolist()
        lo = hi
    assert sorted(seen) == list(range(len(dm.corpora["test"])))


def test_batches_are_pinned_only_for_a_cuda_trainer(dm):
    """Token-batched loaders pin their batches when the attached trainer runs on CUDA (an
    asynchronous copy to the GPU), not otherwise."""
    from types import SimpleNamespace

    saved = dm.trainer
    try:
        assert not dm.train_dataloader().pin_memory
        for device, pinned in (("cpu", False), ("cuda", True)):
            dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
            assert dm.train_dataloader().pin_memory is pinned
    finally:
        dm.trainer = saved

"""Faults of the filesystem, memory and plugins: a corrupt data cache is
rebuilt, a read-only one is one line naming the fix, out of memory names the setting to lower in every
main, a precision plugin that is not installed names its package, and a model with a per-layer schedule
is named by its schedule in every output.

Every case goes through the real mains in-process (``sys.argv`` patched, as ``test_run_boundaries.py``);
docs/reliability.md ("A checkpoint is data, ...") maps each class to its test.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cli_cases import TEXT_TINY, call, one_clear_line

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))


def train(run: Path, cache: Path, args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``posformer-train`` on a tiny char-level text run (``data=text``) with its own cache dir."""
    from posformer.cli.train import main

    argv = ["posformer-train", *TEXT_TINY, "callbacks.model_checkpoint.monitor=null", "torch_threads=1"]
    argv += [f"hydra.run.dir={run}", f"paths.root_dir={run.parent}", f"paths.cache_dir={cache}"]
    return call(main, [*argv, *args], monkeypatch, capsys)


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


# ------------------------------------------------------------------------------ 1. the data cache
def stream_cache(cache: Path) -> Path:
    """The one ``<cache>/text/<key>`` folder a run built."""
    (found,) = [p for p in (cache / "text").iterdir() if (p / "meta.json").exists()]
    return found


def files_of(store: Path) -> dict[str, bytes]:
    """Every file of a token store but its index, by relative path."""
    files = [p for p in store.rglob("*") if p.is_file() and p.name != "meta.json"]
    return {str(p.relative_to(store)): p.read_bytes() for p in files}


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("train/000000.bin", lambda b: b[: len(b) // 2]),  # truncated (a copy or a write cut short)
        ("val/000000.bin", lambda b: b"\x00" * len(b)),  # garbage of the right size
        ("meta.json", lambda b: b'{"key": '),  # truncated JSON
        ("vocab.json", lambda b: b"not json"),
    ],
    ids=["truncated_train", "garbage_val", "truncated_meta", "garbage_tokenizer"],
)
def test_a_corrupt_data_cache_is_rebuilt_with_one_warning(
    name, damage, text_file, tmp_path, monkeypatch, capsys
):
    """A damaged file in the stream cache: one warning line names it, the cache is rebuilt, the run
    trains (exit 0), and the rebuilt cache equals the first one byte for byte."""
    cache = tmp_path / "cache"
    code, text = train(tmp_path / "run1", cache, ["data=text", f"data.path={text_file}"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    folder = stream_cache(cache)
    if not (folder / name).exists():
        pytest.skip(f"this tokenizer keeps no {name}")
    before = files_of(folder)
    (folder / name).write_bytes(damage((folder / name).read_bytes()))
    code, text = train(tmp_path / "run2", cache, ["data=text", f"data.path={text_file}"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    line = one_clear_line(code, text, 0, "corrupt", str(folder))
    assert "rebuil" in line and name in line, line
    assert files_of(stream_cache(cache)) == before


def _read_only_at_write(monkeypatch) -> None:
    """The cache's file system is read-only: creating the build folder fails with EROFS (as root, a
    chmod cannot make a directory unwritable, so the OS error is raised where the write happens: here the
    store's first file, its lock)."""
    import posformer.data.building as building

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(building, "hold_lock", read_only)  # the lock file: opened through posformer.io


def _not_writable(monkeypatch) -> None:
    """The cache dir is not writable for this user (``os.access`` says so; root is never refused)."""
    import posformer.data.cache as cache_mod

    fake_os = SimpleNamespace(access=lambda path, mode: False, W_OK=os.W_OK, X_OK=os.X_OK)
    monkeypatch.setattr(cache_mod, "os", fake_os)


@pytest.mark.parametrize("make_read_only", [_read_only_at_write, _not_writable], ids=["erofs", "no_access"])
def test_a_read_only_data_cache_is_one_line_naming_the_fix(
    make_read_only, text_file, tmp_path, monkeypatch, capsys
):
    """A cache that cannot be written: exit 1, one line naming the cache dir and the settings that move
    it (``paths.cache_dir=``, ``POSFORMER_CACHE=``); main: the OS error's generic fix (hydra.run.dir)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    make_read_only(monkeypatch)
    code, text = train(tmp_path / "run", cache, ["data=text", f"data.path={text_file}"], monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "data cache", str(cache))
    assert "paths.cache_dir=" in line and "POSFORMER_CACHE=" in line, line
    assert not (cache / "text").exists() or not any((cache / "text").iterdir())


# ------------------------------------------------------------------------------ 2. out of memory
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"
)


def test_out_of_memory_in_inspect_names_max_len(tmp_path, monkeypatch, capsys):
    """posformer-inspect out of memory drawing the position x position logits (here CPU's allocator
    message): exit 1, one line naming max_len (main: a traceback, this message was not recognised; and
    torch.OutOfMemoryError named data.batch_size, which inspect does not have)."""
    import posformer.cli.inspect as inspect_cli

    def oom(*args, **kwargs):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(inspect_cli, "_logits_section", oom)
    argv = [
        "posformer-inspect",
        "pe=rope",
        "model.d_model=16",
        "max_len=8",
        f"hydra.run.dir={tmp_path / 'i'}",
    ]
    code, text = call(inspect_cli.main, argv, monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "posformer-inspect: error: out of memory")
    assert "not enough memory" in line and "lower max_len" in line and "data.batch_size" not in line, line


def test_out_of_memory_in_eval_outside_the_sweep_names_eval_settings(
    tiny_run_dir, tmp_path, monkeypatch, capsys
):
    """posformer-eval out of memory before its sweep (building the model and data): exit 2, one line
    naming eval.batch_tokens and eval.attention_chunk_mb, not training's data.batch_size (main)."""
    import torch

    import posformer.eval.run as eval_run
    from tests.cli_cases import eval_cli

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")

    monkeypatch.setattr(eval_run, "build_subjects", oom)
    ckpt = tiny_run_dir / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], tmp_path / "ev", monkeypatch, capsys
    )
    line = one_clear_line(code, text, 2, "posformer-eval: error: out of memory")
    assert "eval.batch_tokens" in line and "eval.attention_chunk_mb" in line, line
    assert "data.batch_size" not in line, line


def test_cpu_out_of_memory_in_training_names_the_batch(text_file, tmp_path, monkeypatch, capsys):
    """posformer-train whose step runs out of host memory with the CPU allocator's "not enough memory":
    exit 1, one line naming data.batch_size (main: a traceback, the message was not recognised)."""
    from posformer.lit.modules import PosformerModule

    real = PosformerModule.training_step

    def step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError(CPU_OOM)
        return real(self, batch, batch_idx)

    monkeypatch.setattr(PosformerModule, "training_step", step)
    code, text = train(
        tmp_path / "run", tmp_path / "cache", ["data=text", f"data.path={text_file}"], monkeypatch, capsys
    )
    line = one_clear_line(code, text, 1, "out of memory at training step 2")
    assert "data.batch_size=" in line and "not enough memory" in line, line


# ------------------------------------------------------------------------------ 3. precision plugins
@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_a_precision_plugin_that_is_not_installed_names_its_package(
    precision, text_file, tmp_path, monkeypatch, capsys
):
    """``trainer.precision=transformer-engine`` without its package: exit 1, one line naming the package
    and the pip command, and nothing written into the run dir (main: Lightning's ModuleNotFoundError
    traceback after config.yaml and the tokenizer were written)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    run = tmp_path / "run"
    code, text = train(
        run,
        tmp_path / "cache",
        ["data=text", f"data.path={text_file}", f"trainer.precision={precision}"],
        monkeypatch,
        capsys,
    )
    line = one_clear_line(code, text, 1, f"trainer.precision={precision}", "transformer_engine")
    assert "pip install 'transformer_engine[pytorch]'" in line, line
    assert not (run / "config.yaml").exists() and not (run / "tokenizer").exists()


# ------------------------------------------------------------------------------ 4. scheduled models named
def test_describe_schedule_names_every_layer_and_keeps_unscheduled_names():
    """``pe`` unchanged without a schedule; the PE of each layer, runs collapsed, a repeated period once
    with its count, kinds added when the PE names alone do not tell them apart, places of an
    encoder-decoder."""
    from posformer.model.config import describe_schedule

    irope = {
        "pe": "rope",
        "n_layers": 4,
        "layer_kinds": {
            "rope_chunked": {"pe": "rope", "span": {"kind": "chunked", "window": 32}},
            "nope_global": {"pe": "nope"},
        },
        "layers": {"pattern": ["rope_chunked", "rope_chunked", "rope_chunked", "nope_global"]},
    }
    assert describe_schedule({"pe": "alibi", "n_layers": 4}) == "alibi"
    assert describe_schedule({"pe": "alibi", "layer_kinds": {}, "layers": {}}) == "alibi"
    assert describe_schedule(irope) == "rope×3+nope×1"
    assert describe_schedule({**irope, "n_layers": 8}) == "(rope×3+nope×1)×2"
    assert describe_schedule({**irope, "n_layers": 6}) == "rope×3+nope×1+rope×2"  # the pattern cut
    gemma = {
        "pe": "rope",
        "n_layers": 6,
        "layer_kinds": {
            "local": {"pe": "rope", "pe_options": {"base": 1e4}},
            "global": {"pe": "rope", "pe_options": {"base": 1e6}},
        },
        "layers": {"pattern": ["local"] * 5 + ["global"]},
    }
    assert describe_schedule(gemma) == "rope×6 [local×5+global×1]"
    encdec = {
        "kind": "encoder_decoder",
        "pe": "t5",
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "layer_kinds": {"n": {"pe": "nope"}},
        "layers": {"decoder": ["n", "n"]},
    }
    assert describe_schedule(encdec) == "encoder t5×2 / decoder nope×2"


def test_a_scheduled_model_is_named_by_its_schedule_in_every_output(text_file, tmp_path, monkeypatch, capsys):
    """``model=decoder_irope`` through posformer-train and posformer-eval: the console model line, the
    results.{json,md} header and the evaluation label say ``rope×3+nope×1`` (main: ``pe=rope``, as if
    every layer were RoPE); ``results.json``'s ``pe`` stays the model's PE."""
    import json

    from posformer.cli.train import main
    from tests.cli_cases import eval_cli

    tiny = [a for a in TEXT_TINY if not a.startswith("model.")]
    run, cache = tmp_path / "run", tmp_path / "cache"
    argv = [
        "posformer-train",
        *tiny,
        "model=decoder_irope",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
    ]
    argv += [
        "callbacks.model_checkpoint.monitor=null",
        "torch_threads=1",
        "data=text",
        f"data.path={text_file}",
    ]
    argv += [f"hydra.run.dir={run}", f"paths.root_dir={tmp_path}", f"paths.cache_dir={cache}"]
    code, text = call(main, argv, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "pe=rope×3+nope×1, d_model=16" in text, text[-3000:]  # the console model line
    assert "decoder / pe=rope×3+nope×1 / seed=0" in text  # the console results title
    results = json.loads((run / "results.json").read_text())
    assert results["pe"] == "rope" and results["pe_schedule"] == "rope×3+nope×1"
    assert "decoder, pe=rope×3+nope×1, seed=0" in (run / "results.md").read_text(encoding="utf-8")
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "ev"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[8]"], out, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    rows = json.loads((out / "extrapolation.json").read_text(encoding="utf-8"))["results"]
    assert {r["label"] for r in rows} == {"rope×3+nope×1 [run]"}
    # posformer-inspect run=: the schedule, and which layer's PE its figures draw
    from posformer.cli.inspect import compose_config, inspect_pe

    drawn = inspect_pe(compose_config([f"run={run}", "max_len=8"]), tmp_path / "inspect")
    assert drawn["schedule"] == "rope×3+nope×1" and drawn["module"]
    line = f"schedule: rope×3+nope×1 (the figures draw the PE module {drawn['module']!r})"
    assert line in capsys.readouterr().out
    assert "rope×3+nope×1 [run]" in text and "rope×3+nope×1 [run]" in (out / "extrapolation.md").read_text(
        encoding="utf-8"
    )


def test_an_unscheduled_model_keeps_its_names(tiny_run_dir):
    """The session's tiny rope run (no schedule): no ``pe_schedule`` key, header ``pe=rope`` as before."""
    import json

    results = json.loads((tiny_run_dir / "results.json").read_text())
    assert "pe_schedule" not in results and results["pe"] == "rope"
    assert ", pe=rope, seed=" in (tiny_run_dir / "results.md").read_text(encoding="utf-8")


def _parallel_corpus(directory: Path) -> Path:
    directory.mkdir()
    for split, n in (("train", 60), ("val", 12), ("test", 12)):
        for lang, word in (("de", "hund katze maus"), ("en", "dog cat mouse")):
            lines = [" ".join(word.split()[: 1 + (i % 3)]) + f" {i % 7}." for i in range(n)]
            (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


@pytest.mark.parametrize(
    ("name", "damage"),
    [("train/src/000000.bin", b"\x01\x00 cut"), ("tokenizer.json", b"{")],
    ids=["truncated_shard", "garbage_tokenizer"],
)
def test_a_corrupt_translation_cache_file_is_rebuilt(name, damage, tmp_path, caplog):
    """data=translation's cache (tokenizer.json, a split's shards): a damaged file is named in one
    warning, removed and rebuilt; the rebuilt data equals the first build."""
    import logging

    import numpy as np

    from posformer.data import build_datamodule

    cfg = {"name": "translation", "path": str(_parallel_corpus(tmp_path / "corpus")), "vocab_size": 300}
    cfg |= {"splits": {"train": "train", "val": "val", "test": "test"}, "min_frequency": 1}
    cfg |= {"max_tokens": 64, "max_len": 32, "cache_dir": str(tmp_path / "cache")}
    first = build_datamodule(cfg, "encoder_decoder", 0)
    (first.cache_path / name).write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="posformer.data"):
        again = build_datamodule(cfg, "encoder_decoder", 0)
    warned = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    folder, _, rest = name.partition("/")
    assert len(warned) == 1 and str(first.cache_path / folder) in warned[0] and rest in warned[0], warned
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    a, b = first.corpora["train"], again.corpora["train"]
    assert np.array_equal(a.src_lens, b.src_lens) and np.array_equal(a.tgt_lens, b.tgt_lens)
    assert (first.cache_path / name).stat().st_size > len(damage)  # rewritten whole


def test_a_damaged_synthetic_task_cache_is_generated_again(tmp_path: Path) -> None:
    """A truncated ``.arrow`` file in the HF cache of a generated task split (it loaded
    with pyarrow's ArrowInvalid traceback) is removed with one warning and the split generated again:
    the same examples."""
    import warnings

    import posformer.data.synthetic as syn
    from posformer.data.options import SyntheticOptions

    options = dataclasses.asdict(SyntheticOptions())
    first = syn.build_split("reverse", 20, (1, 8), 0, "train", options, str(tmp_path))[:]
    (arrow,) = tmp_path.rglob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = syn.build_split("reverse", 20, (1, 8), 0, "train", options, str(tmp_path))[:]
    lines = [str(w.message) for w in caught if "data cache" in str(w.message)]
    assert len(lines) == 1 and "is damaged (ArrowInvalid" in lines[0]
    assert "generating the split again" in lines[0]
    assert again == first

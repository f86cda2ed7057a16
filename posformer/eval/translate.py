"""Translate a test set with an encoder-decoder checkpoint and score it with sacreBLEU
(``posformer-eval eval=translate``; keys documented in ``configs/eval/translate.yaml``).

    posformer-eval eval=translate eval.run_dir=outputs/multi30k_de_en/<time> eval.average_last=5
    posformer-eval eval=translate eval.checkpoint=path/to/model.ckpt eval.beam_size=4 eval.alpha=0.6

:func:`run_translate` loads the checkpoint (optionally the mean of a run's last N checkpoints,
:mod:`posformer.eval.averaging`), rebuilds the run's datamodule (its joint BPE comes from the cache, or is
retrained identically from the same files), translates ``eval.split`` with batched beam search
(:func:`posformer.eval.decoding.beam_search`; paper: beam 4, alpha 0.6, max length = input + 50), detokenises
and writes ``hyps.txt`` (one line per source sentence, corpus order) and ``scores.json`` (corpus BLEU and
chrF on the raw detokenised text, with the sacreBLEU signatures) into the output directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from posformer.checkpoints import (
    last_checkpoints,
    load_checkpoint,
    load_run_config,
    peek_model_config,
    pick_run_checkpoint,
)
from posformer.configs.eval_schema import EvalRootConfig, TranslateConfig
from posformer.data import build_datamodule
from posformer.devices import CUDA_ACCELERATORS, resolve_trainer, torch_device_name
from posformer.errors import CheckpointError, ConfigError
from posformer.eval.averaging import average_checkpoints
from posformer.eval.decoding import beam_search
from posformer.eval.settings import translate_problems
from posformer.io import atomic_write_text, check_writable_dir
from posformer.rules import raise_problems, rule_problems

DEFAULTS: dict[str, Any] = {
    "name": "translate",
    "checkpoint": None,
    "run_dir": None,
    "average_last": 0,
    "up_to_step": None,
    "which": "last",
    "split": "test",
    "beam_size": 4,
    "alpha": 0.6,
    "max_len_a": 1.0,
    "max_len_b": 50,
    "max_tokens": 4096,
    "limit": None,
    "data": {},
    "output_dir": None,
    "device": "auto",
    "progress": True,
}


def score_translations(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a") -> dict[str, Any]:
    """Corpus BLEU and chrF (sacreBLEU) of detokenised ``hyps`` against one reference each."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise ConfigError(f"{len(hyps)} hypotheses but {len(refs)} references; they must pair up one to one.")
    bleu, chrf = BLEU(tokenize=tokenize), CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {
        "bleu": round(float(b.score), 2),
        "chrf": round(float(c.score), 2),
        "bleu_detail": str(b),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bp": round(float(b.bp), 4),
        "sys_len": int(b.sys_len),
        "ref_len": int(b.ref_len),
        "n_sentences": len(hyps),
    }


def _options(cfg: Any) -> dict[str, Any]:
    """``eval``'s options: the settings' (checked by :func:`~posformer.eval.settings.read_eval`), or a
    mapping's over :data:`DEFAULTS`, checked here by the same rules."""
    if isinstance(cfg, EvalRootConfig):
        return dataclasses.asdict(cfg.eval)
    ecfg = dict(cfg.get("eval") if hasattr(cfg, "get") and "eval" in cfg else cfg or {})
    unknown = sorted(set(ecfg) - set(DEFAULTS))
    if unknown:
        raise ConfigError(
            f"eval (translate): unknown key(s) {unknown}; valid: {', '.join(sorted(DEFAULTS))}."
        )
    o = {**DEFAULTS, **ecfg}
    raise_problems(rule_problems(TranslateConfig, "eval.", o) + translate_problems(o))
    return o


def _device(option: str, cfg: Any) -> torch.device:
    """``eval.device``; ``auto``: the device ``trainer.accelerator`` resolves to (CUDA when there is one
    for the default ``auto``, :func:`posformer.devices.resolve_trainer`; ``trainer=gpu`` without CUDA is
    a :class:`ConfigError`)."""

    if option != "auto":
        return torch.device(option)
    trainer = (
        cfg.trainer
        if isinstance(cfg, EvalRootConfig)
        else cfg.get("trainer")
        if hasattr(cfg, "get")
        else None
    )
    accelerator = resolve_trainer(trainer or {}).accelerator
    return torch.device("cuda" if accelerator in CUDA_ACCELERATORS else "cpu")


def _output_dir(o: Mapping[str, Any], cfg: Any) -> Path:
    if o["output_dir"]:
        return Path(o["output_dir"])
    try:
        return Path(cfg.paths["output_dir"] if isinstance(cfg, EvalRootConfig) else cfg.paths.output_dir)
    except Exception:  # noqa: BLE001 - no Hydra run dir: next to the checkpoint
        base = Path(o["run_dir"]) if o["run_dir"] else Path(o["checkpoint"]).parent
        return base / "translate"


def translate_corpus(
    model: torch.nn.Module,
    dm: Any,
    split: str,
    *,
    beam_size: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    max_tokens: int,
    limit: int | None = None,
    device: torch.device | None = None,
    progress: bool = False,
) -> list[str]:
    """Detokenised beam-search translations of ``dm``'s ``split`` in corpus order (one string per sentence).

    Batches hold at most ``max_tokens // beam_size`` source tokens (``src_ids`` (B, S)), so the beam
    rows of one batch (B*K, S) stay within ``max_tokens``.
    """

    device = device or torch.device("cpu")
    corpus = dm.corpora[split]
    n = len(corpus) if limit is None else min(int(limit), len(corpus))
    hyps: list[str | None] = [None] * n
    loader = dm.split_dataloader(split, max_tokens=max(1, max_tokens // beam_size), limit=n)
    done, started = 0, time.perf_counter()
    for batch in loader:
        src, mask = batch["src_ids"].to(device), batch["src_mask"].to(device)
        out = beam_search(
            model, src, mask, beam_size=beam_size, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b
        )
        for i, tokens in zip(batch["idx"].tolist(), out):
            hyps[i] = dm.decode(tokens)
        done += len(out)
        if progress:
            print(
                f"\r[translate] {done}/{n} sentences, {time.perf_counter() - started:.0f} s",
                end="",
                flush=True,
            )
    if progress:
        print()
    return [h if h is not None else "" for h in hyps]


def run_translate(cfg: Any) -> dict[str, Any]:
    """Translate ``eval.split`` with beam search and score it; writes ``hyps.txt`` and ``scores.json``.

    ``cfg``: the composed ``posformer-eval`` config (``cfg.eval`` holds the keys of
    ``configs/eval/translate.yaml``) or that ``eval`` mapping itself.
    """
    o = _options(cfg)
    device = _device(str(o["device"]), cfg)  # before any work: trainer=gpu without CUDA is one line
    started = time.perf_counter()
    out_dir = _output_dir(o, cfg)
    check_writable_dir(out_dir, "translation output directory", fix="eval.output_dir=/writable/dir")
    ckpt_path, averaged = _checkpoint(o, out_dir)
    ck = load_checkpoint(ckpt_path, compile=True)  # weights_only=True, CRC-checked, clear errors
    model = ck.model.to(device).eval()
    # beam search runs the float32 model as it is (no autocast): trainer.precision does not apply
    print(f"translating with {ckpt_path}: device {torch_device_name(device)}, precision 32-true", flush=True)
    dm = _datamodule(o, ckpt_path, int(ck.model_cfg["vocab_size"]))
    split = str(o["split"])
    if split not in dm.corpora:
        raise ConfigError(f"eval.split={split!r}; valid: {', '.join(dm.corpora)}.")
    t0 = time.perf_counter()
    hyps = translate_corpus(
        model,
        dm,
        split,
        beam_size=int(o["beam_size"]),
        alpha=float(o["alpha"]),
        max_len_a=float(o["max_len_a"]),
        max_len_b=int(o["max_len_b"]),
        max_tokens=int(o["max_tokens"]),
        limit=o["limit"],
        device=device,
        progress=bool(o["progress"]),
    )
    decode_s = time.perf_counter() - t0
    scores = score_translations(hyps, dm.texts(split)[1][: len(hyps)])
    result = {
        **scores,
        "checkpoint": str(ckpt_path),
        "averaged_from": averaged,
        "split": split,
        "split_name": dm.options.splits[split],
        "src_lang": dm.src_lang,
        "tgt_lang": dm.tgt_lang,
        "beam_size": int(o["beam_size"]),
        "alpha": float(o["alpha"]),
        "max_len": f"{o['max_len_a']} * src_len + {o['max_len_b']}",
        "decode_time_s": round(decode_s, 1),
        "wall_time_s": round(time.perf_counter() - started, 1),
        "device": str(device),
        "output_dir": str(out_dir),
    }
    atomic_write_text(out_dir / "hyps.txt", "\n".join(hyps) + "\n")
    atomic_write_text(out_dir / "scores.json", json.dumps(result, indent=2) + "\n")
    _report(result, scores, o, out_dir, len(hyps))
    return result


def _checkpoint(o: dict[str, Any], out_dir: Path) -> tuple[Path, list[str]]:
    """The checkpoint to translate with (the mean of the last ``average_last``, one named, or the run's
    ``which``) and the paths averaged; refuses a missing file or a model that is not an encoder-decoder."""
    averaged: list[str] = []
    if o["average_last"]:
        ckpt_dir = Path(o["run_dir"]) / "checkpoints"
        if (ckpt_dir / "periodic").is_dir():  # the evenly spaced ones (callbacks.periodic_checkpoint)
            ckpt_dir = ckpt_dir / "periodic"
        up_to = int(o["up_to_step"]) if o["up_to_step"] is not None else None
        paths = last_checkpoints(ckpt_dir, int(o["average_last"]), up_to_step=up_to)
        ckpt_path = average_checkpoints(paths, out_dir / f"averaged_last{len(paths)}.ckpt")
        averaged = [str(p) for p in paths]
    elif o["checkpoint"]:
        ckpt_path = Path(o["checkpoint"])
    else:
        ckpt_path = pick_run_checkpoint(Path(o["run_dir"]), o["which"])
    if not Path(ckpt_path).is_file():
        raise CheckpointError(f"checkpoint {str(ckpt_path)!r} does not exist.")
    kind = peek_model_config(ckpt_path).get("kind")  # a cheap look before the full (CRC-checked) load
    if kind != "encoder_decoder":
        raise CheckpointError(
            f"eval=translate needs an encoder-decoder checkpoint; {str(ckpt_path)!r} has model.kind={kind!r}."
        )
    return Path(ckpt_path), averaged


def _datamodule(o: dict[str, Any], ckpt_path: Path, vocab_size: int) -> Any:
    """The run's parallel corpus (its ``config.yaml``, searched upwards, with ``eval.data`` merged in
    before resolving), checked against the checkpoint's vocabulary."""
    start = Path(o["run_dir"]) if o["run_dir"] else Path(ckpt_path).parent
    run_cfg = load_run_config(start, levels=5, names=("config.yaml",), resolve=False)
    if run_cfg is None and not o["data"]:
        raise ConfigError(
            f"no training config.yaml found above {str(ckpt_path)!r}; pass the data config as "
            "eval.data={name: translation, path: ..., ...}."
        )
    data_cfg = dict((run_cfg or {}).get("data") or {})
    data_cfg.update(dict(o["data"] or {}))
    if run_cfg is not None:  # resolved against the run's config (build_datamodule resolves it)
        data_cfg = OmegaConf.create({**run_cfg, "data": data_cfg}).data
    dm = build_datamodule(data_cfg, "encoder_decoder", int((run_cfg or {}).get("seed", 0) or 0))
    if int(dm.vocab_size) != vocab_size:
        raise CheckpointError(
            f"the data's vocabulary has {dm.vocab_size} tokens but the checkpoint's model has "
            f"{vocab_size}: the BPE differs from the one used in training "
            "(check data.vocab_size / data files / eval.data overrides)."
        )
    return dm


def _report(result: dict[str, Any], scores: dict[str, Any], o: dict[str, Any], out_dir: Path, n: int) -> None:
    """The scores, the sacreBLEU signatures and the written files, on stdout."""
    print(
        f"BLEU = {scores['bleu']:.2f}  chrF = {scores['chrf']:.2f}  ({n} sentences, {result['split']} = "
        f"{result['split_name']}, beam {o['beam_size']}, alpha {o['alpha']})"
    )
    print(f"sacreBLEU: {scores['bleu_detail']}")
    print(f"signature: {scores['bleu_signature']}")
    print(f"           {scores['chrf_signature']}")
    print(f"hypotheses: {out_dir / 'hyps.txt'}\nscores    : {out_dir / 'scores.json'}")

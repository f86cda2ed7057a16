"""``posformer-eval``: evaluate trained checkpoints (Hydra config ``configs/eval.yaml``).

Options of the ``eval`` group:

``eval=extrapolate`` (default)
    Length extrapolation (:mod:`posformer.eval.harness`)::

        posformer-eval eval.checkpoints=[outputs/train/runs/X/checkpoints/last.ckpt] eval.lengths=[128,512]
        posformer-eval eval.sweep_dir=outputs/train/multiruns/X eval.length_multiples=[1,2,4,8,16]
        posformer-eval eval.sweep_dir=... 'eval.rope_scaling={type: yarn, factor: 4}'   # context extension
        posformer-eval ... trainer=gpu                          # same device/precision flags as training

    Results go to the Hydra run dir (or ``eval.output_dir``: reuse it to resume an interrupted sweep).

``eval=translate``
    Translation (BLEU) of an encoder-decoder checkpoint: :func:`posformer.eval.translate.run_translate`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from posformer.errors import CheckpointError, ConfigError, PosformerError
from posformer.eval.harness import (
    EvalSettings,
    LoadedCheckpoint,
    Results,
    Subject,
    evaluate_subjects,
    file_fingerprint,
    find_checkpoints,
    load_checkpoint,
    train_len_max,
)


def _plain(x: Any) -> Any:
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def checkpoint_paths(ecfg: DictConfig) -> list[Path]:
    """``eval.checkpoints`` (a path or a list) plus one checkpoint per run of ``eval.sweep_dir``."""
    paths: list[Path] = []
    ckpts = _plain(ecfg.get("checkpoints")) or []
    if isinstance(ckpts, str):
        ckpts = [ckpts]
    paths += [Path(p) for p in ckpts]
    sweep = ecfg.get("sweep_dir")
    if sweep:
        sweeps = [sweep] if isinstance(sweep, str) else list(sweep)
        for s in sweeps:
            paths += find_checkpoints(s, ecfg.get("which", "best"))
    if not paths:
        raise ConfigError(
            "posformer-eval eval=extrapolate needs checkpoints: set eval.checkpoints=[path/to.ckpt] or "
            "eval.sweep_dir=path/to/training/multirun."
        )
    return paths


def build_data(ck: LoadedCheckpoint, overrides: dict[str, Any]) -> Any:
    """The datamodule a checkpoint was trained on (``eval.data`` merged over its data config), set up."""
    from posformer.data import build_datamodule

    data_cfg = OmegaConf.merge(OmegaConf.create(ck.data_cfg), OmegaConf.create(overrides or {}))
    dm = build_datamodule(data_cfg, ck.model_cfg.get("kind", "decoder"), ck.seed)
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    if hasattr(dm, "setup"):
        dm.setup("test")
    return dm


def _label(ck: LoadedCheckpoint, labels: list[str] | None, index: int) -> str:
    if labels and index < len(labels):
        return str(labels[index])
    run = Path(ck.path).resolve().parent.parent.name
    return f"{ck.pe} [{run}]"


def build_subjects(ecfg: DictConfig) -> tuple[list[Subject], list[int]]:
    """Load every checkpoint and its data; returns the subjects (× rope scalings) and the lengths."""
    overrides = _plain(ecfg.get("data")) or {}
    labels = _plain(ecfg.get("labels"))
    scalings = _plain(ecfg.get("rope_scaling"))
    if scalings is None or isinstance(scalings, dict):
        scalings = [scalings]
    subjects: list[Subject] = []
    train_lens: list[int] = []
    for i, path in enumerate(checkpoint_paths(ecfg)):
        ck = load_checkpoint(path)
        dm = build_data(ck, overrides)
        vocab, trained_vocab = getattr(dm, "vocab_size", None), ck.model_cfg.get("vocab_size")
        if vocab is not None and trained_vocab is not None and int(vocab) != int(trained_vocab):
            raise CheckpointError(
                f"checkpoint {str(path)!r} was trained with a vocabulary of {trained_vocab} tokens, but the "
                f"evaluation data (its data config + eval.data={overrides}) has {vocab}; drop the eval.data "
                "overrides that change the tokenizer or symbols."
            )
        task_type = getattr(dm, "task_type", "lm")
        if task_type == "translation":
            raise ConfigError(
                f"{path} is a translation model; length extrapolation covers LM and synthetic tasks. Use "
                "posformer-eval eval=translate for BLEU."
            )
        train_len = getattr(dm, "train_length", None) or ck.train_len
        if isinstance(train_len, list):
            train_len = tuple(train_len)
        tl = train_len_max(train_len)
        if tl:
            train_lens.append(tl)
        data: Any = dm
        for sc in scalings:
            if sc and ck.model_cfg.get("pe") not in ("rope", "xpos"):
                continue  # context-extension methods apply to rotary PEs only
            import copy

            model = ck.model if sc is None else copy.deepcopy(ck.model)
            subjects.append(
                Subject(
                    label=_label(ck, labels, i),
                    model=model,
                    task_type=task_type,
                    data=data,
                    train_len=train_len,
                    checkpoint=str(path),
                    pe=ck.pe,
                    scaling=sc,
                    fingerprint=file_fingerprint(path),
                )
            )
    lengths = _plain(ecfg.get("lengths"))
    if not lengths:
        multiples = _plain(ecfg.get("length_multiples")) or [1, 2, 4, 8, 16]
        if not train_lens:
            raise ConfigError(
                "eval.lengths is not set and the checkpoints record no training length; set eval.lengths."
            )
        lengths = sorted({int(m * t) for m in multiples for t in set(train_lens)})
    return subjects, [int(x) for x in lengths]


def output_dir(cfg: DictConfig) -> Path:
    if cfg.eval.get("output_dir"):
        return Path(cfg.eval.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not under Hydra
        return Path.cwd()


def make_fabric(cfg: DictConfig) -> Any:
    """A Fabric with the training flags ``trainer.accelerator/devices/precision`` (one device)."""
    from lightning.fabric import Fabric

    t = cfg.get("trainer") or {}
    fabric = Fabric(
        accelerator=t.get("accelerator", "auto"), devices=1, precision=t.get("precision", "32-true")
    )
    return fabric


def run_extrapolation(cfg: DictConfig) -> Results:
    """``eval=extrapolate``: evaluate the configured checkpoints at every length; returns the results."""
    ecfg = cfg.eval
    subjects, lengths = build_subjects(ecfg)
    settings = EvalSettings(
        lengths=lengths,
        modes=tuple(_plain(ecfg.get("modes")) or ("nonoverlap", "sliding")),
        stride=ecfg.get("stride", 0.5),
        n_tokens=ecfg.get("n_tokens"),
        windows_at_max=int(ecfg.get("windows_at_max", 4)),
        batch_tokens=int(ecfg.get("batch_tokens", 16384)),
        attention_chunk_mb=ecfg.get("attention_chunk_mb"),
        max_batches=ecfg.get("max_batches"),
        progress=bool(ecfg.get("progress", True)),
    )
    out = output_dir(cfg)
    meta = {"command": " ".join(["posformer-eval", *sys.argv[1:]]), "config": _plain(ecfg)}
    results = evaluate_subjects(
        subjects,
        settings,
        out,
        fabric=make_fabric(cfg),
        meta=meta,
        tensorboard=bool(ecfg.get("tensorboard", True)),
    )
    print(f"[posformer-eval] results in {out}/extrapolation.md (.json, .csv, *.png, tensorboard/)")
    return results


def _choice(cfg: DictConfig) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get("eval")
        if choice:
            return str(choice)
    except Exception:
        pass
    return str(cfg.eval.get("name", "extrapolate"))


def dispatch(cfg: DictConfig) -> Any:
    choice = _choice(cfg)
    if choice == "extrapolate":
        return run_extrapolation(cfg)
    if choice == "translate":
        from posformer.eval.translate import run_translate

        return run_translate(cfg)
    raise ConfigError(f"eval={choice!r} is unknown; valid: extrapolate, translate.")


def main() -> None:
    import hydra

    import posformer.configs  # noqa: F401  (registers the config resolvers, e.g. ${posformer_cwd:})
    from posformer.io import precheck_run_dir

    try:
        precheck_run_dir(sys.argv[1:])  # Hydra creates the run dir first and would fail with a traceback
    except PosformerError as exc:
        print(f"posformer-eval: error: {exc}", file=sys.stderr)
        sys.exit(2)

    @hydra.main(version_base="1.3", config_path="../configs", config_name="eval")
    def _main(cfg: DictConfig) -> None:
        try:
            dispatch(cfg)
        except PosformerError as exc:
            print(f"posformer-eval: error: {exc}", file=sys.stderr)
            sys.exit(2)

    _main()


if __name__ == "__main__":
    main()

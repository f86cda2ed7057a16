"""Shared pytest fixtures. Tests request them by name; nothing here is imported.

``tiny_config``        factory fixture: ``tiny_config(pe, kind="decoder", **overrides) -> ModelConfig``
``tiny_model``         factory fixture: ``tiny_model(pe, kind="decoder", seed=0, **overrides)``, in eval mode
``tiny_run_dir``       session-scoped: the run dir of a tiny rope model trained for 4 steps through
                       ``posformer.cli.train.run`` (``checkpoints/last.ckpt``, ``config.yaml``,
                       ``results.json``). Shared by every test of the session: read it, copy it, never
                       write into it.
``tiny_checkpoint``    ``tiny_run_dir / "checkpoints" / "last.ckpt"``
``read_extrapolate``   factory fixture: ``read_extrapolate(**eval_values)``: the shipped ``eval=extrapolate``
                       config with those ``eval.*`` values, read by ``posformer.eval.settings.read_eval``
``fresh_compiles``     an empty dynamo cache around a test and Flex's eager-mode warnings silenced (modules
                       that call Flex for many lengths: ``pytestmark = pytest.mark.usefixtures(...)``)

Lists of PE names for ``@pytest.mark.parametrize`` come from the library itself
(``posformer.pe.list_encodings()``; causal-only PEs via ``ENCODINGS[name].causal_only``).

Markers: ``slow`` (subprocesses, DDP, kill-and-resume, multiruns, torch.compile, whole training runs,
and the per-PE grid cases past a representative one). ``make test`` runs everything (the others on
two pytest-xdist workers, then these, also on two workers), ``make test-fast`` deselects them
(``-m "not slow"``); ``--strict-markers`` rejects unknown markers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from posformer.model import ModelConfig, build_model
from posformer.pe import ENCODINGS
from tests.cli_cases import TINY_RUN  # noqa: E402  (tests/ is on sys.path for conftest and tests)

#: the ``posformer-train`` overrides of :func:`tiny_run_dir`: 1 layer, d_model 16, 4 steps, no loggers
TINY_TRAIN_OVERRIDES = TINY_RUN


@pytest.fixture(autouse=True)
def _keep_denormals():
    """Entry points called in-process flush float32 denormals for the whole process
    (:func:`posformer.cpu.configure_cpu`); every test starts from torch's default (kept)."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(autouse=True)
def _no_hydra_run_left_behind():
    """A Hydra main called in-process leaves its run's ``HydraConfig`` set for the whole process (a
    process of the command line runs one); every test starts without one, so a relative data path
    resolves from the test's own working directory, not a previous test's Hydra run."""
    yield
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


def _tiny_config(pe: str, kind: str = "decoder", **overrides: Any) -> ModelConfig:
    """A 1-layer, d_model=16, 2-head config, dropout off; causal-only PEs stay out of the encoder."""
    encoder = pe in ENCODINGS and not ENCODINGS[pe].causal_only
    pe_apply = {"encoder": encoder, "decoder": True, "cross": False}
    values: dict[str, Any] = dict(
        kind=kind,
        vocab_size=13,
        d_model=16,
        n_heads=2,
        n_layers=1,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        pe=pe,
        pe_apply=pe_apply,
    )
    values.update(overrides)
    return ModelConfig(**values)


def _tiny_model(pe: str, kind: str = "decoder", seed: int = 0, **overrides: Any):
    """:func:`_tiny_config` built into a model in eval mode, after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return build_model(_tiny_config(pe, kind, **overrides)).eval()


@pytest.fixture
def tiny_config() -> Callable[..., ModelConfig]:
    """Factory: ``tiny_config(pe, kind="decoder", **overrides)`` -> a 1-layer, d_model=16, 2-head
    :class:`ModelConfig` (vocabulary 13, d_ff 32, dropout 0; causal-only PEs off in the encoder)."""
    return _tiny_config


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory: ``tiny_model(pe, kind="decoder", seed=0, **overrides)`` -> ``tiny_config``'s model,
    seeded, in eval mode."""
    return _tiny_model


def _loss_and_grads(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], policy: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of ``model(*args)`` under the attention ``policy``
    (:class:`~posformer.model.policy.BackendPolicy`): the loss (the logits' log-sum-exp, averaged)
    and every parameter gradient, by name."""
    model.attention_policy = policy
    model.zero_grad()
    loss = model(*args).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_training_step(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], off: str, used: list[int], param: str
) -> None:
    """A training step with backend ``off`` switched off, then with it on: ``used`` (appended to by a
    spy on the path under test) stays empty in the first and fills in the second; the losses and every
    parameter gradient agree, fp32 to 1e-5, and some parameter named with ``param`` has a gradient."""
    from posformer.model.context import BackendPolicy

    ref_loss, ref = _loss_and_grads(model, args, BackendPolicy(off=frozenset({off})))
    assert not used
    loss, grads = _loss_and_grads(model, args, BackendPolicy())
    assert used  # the path under test ran with gradients on
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref.keys() and any(param in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], atol=1e-5, rtol=1e-5, msg=name)


def _decoder_batch(rows: str) -> tuple[torch.Tensor | None, ...]:
    """A tiny decoder's forward arguments for 2 rows of 40 tokens (seed 0): ``plain`` (input_ids,);
    ``left-padded``, row 1's first 7 tokens padding (queries that see no key); ``packed``, documents of
    25 + 15 and 12 + 28 tokens (the model's restarting positions)."""
    x = torch.randint(0, 13, (2, 40), generator=torch.Generator().manual_seed(0))
    if rows == "left-padded":  # (input_ids, positions, attention_mask)
        pad = torch.ones(2, 40, dtype=torch.bool)
        pad[1, :7] = False
        return (x, None, pad)
    if rows == "packed":  # (input_ids, positions, attention_mask, cache, segment_ids)
        seg = torch.zeros(2, 40, dtype=torch.long)
        seg[0, 25:], seg[1, 12:] = 1, 1
        return (x, None, None, None, seg)
    return (x,)


@pytest.fixture
def decoder_batch() -> Callable[[str], tuple[torch.Tensor | None, ...]]:
    """Factory: ``decoder_batch(rows)``, rows ``plain``, ``left-padded`` or ``packed``
    (:func:`_decoder_batch`)."""
    return _decoder_batch


def _read_extrapolate(**eval_values: Any) -> Any:
    """``posformer-eval``'s shipped ``eval=extrapolate`` config, ``eval_values`` set in its ``eval``
    section (a checkpoint path unless given), read once (:func:`posformer.eval.settings.read_eval`: raises
    its one ``ConfigError``)."""
    from hydra import compose, initialize_config_module

    from posformer.eval.settings import read_eval

    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("eval", overrides=["paths.output_dir=eval-out"])  # no Hydra run: nothing is written
    for key, value in {"checkpoints": ["model.ckpt"], **eval_values}.items():
        cfg.eval[key] = value
    return read_eval(cfg, "extrapolate")


@pytest.fixture
def read_extrapolate() -> Callable[..., Any]:
    """Reader: ``read_extrapolate(**eval_values)`` (:func:`_read_extrapolate`)."""
    return _read_extrapolate


@pytest.fixture
def same_training_step() -> Callable[..., None]:
    """Checker: ``same_training_step(model, args, off, used, param)``: a backend's training path equals
    the path it replaces (``off`` switched off) in loss and every gradient (:func:`_same_training_step`)."""
    return _same_training_step


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory) -> Path:
    """A tiny rope model trained for 4 steps by ``posformer.cli.train.run`` (built once per session).

    Returns its run dir (``checkpoints/last.ckpt``, ``config.yaml``, ``results.json``). Shared by
    every test: read or copy it, never write into it.
    """
    from hydra import compose, initialize_config_module

    from posformer.cli.train import run

    root = tmp_path_factory.mktemp("tiny_run")
    overrides = [
        *TINY_TRAIN_OVERRIDES,
        f"paths.root_dir={root}",
        f"paths.output_dir={root}/run",
        f"paths.cache_dir={root}/cache",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 16-wide model: one thread is as fast and fights no one for the cores
    try:
        with initialize_config_module("posformer.configs", version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    run_dir = root / "run"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    return run_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run_dir: Path) -> Path:
    """``last.ckpt`` of :func:`tiny_run_dir` (read-only by convention: copy it to change it)."""
    return tiny_run_dir / "checkpoints" / "last.ckpt"


# ------------------------------------------------------------------------------------------ bad-input cases
@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A data/tokenizer cache shared by the command-line cases (``paths.cache_dir``)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """A run dir that already holds an earlier results.json and checkpoint (a failed run must leave both
    byte-identical: ``cli_cases.assert_untouched``)."""
    from tests.cli_cases import SENTINEL_CKPT, SENTINEL_RESULTS

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "results.json").write_bytes(SENTINEL_RESULTS)
    (run / "checkpoints" / "last.ckpt").write_bytes(SENTINEL_CKPT)
    return run


@pytest.fixture(scope="session")
def trained(tiny_run_dir) -> Path:
    """The session's tiny trained run (``tiny_run_dir``); the checkpoint cases only read or copy it."""
    return tiny_run_dir


@pytest.fixture
def fresh_compiles() -> Iterator[None]:
    """An empty dynamo cache around the test: every Flex call (eager Flex traces too) counts towards
    ``flex.RECOMPILE_LIMIT`` graphs per process. Silences eager Flex's warnings (the CPU tests call
    the uncompiled kernel on purpose)."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield
    torch._dynamo.reset()

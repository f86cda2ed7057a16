"""The device guard: a CPU-only suite catches the tensors a GPU run would find on the wrong device.

On CUDA, a tensor made without ``device=`` (``torch.ones(...)``, ``torch.arange(...)``) lands on the
CPU and the first operation that meets a ``cuda:0`` tensor raises "Expected all tensors to be on the
same device" — the crash that stopped 9 of 14 PEs at train start. Here the model and its inputs stay
on the CPU while ``meta`` is the *default* device (:func:`foreign_default_device`): the same tensor
lands on ``meta``, and the same operation raises on the CPU. Every test below runs real code under
that guard — both models, self and cross attention, padding, packed rows, cached decoding (greedy,
beam, sampling), the heat-map callback, ``position_logits``, the inspection figures, one training
step and one evaluation batch, for every registered PE.

The second guard, :func:`test_training_step_on_the_meta_device_makes_no_host_sync`, runs a training
step with the whole model on ``meta``: a CPU tensor made on purpose fails there too, and so does a
host sync (``int(t)``, ``.item()``, ``.tolist()``: a meta tensor has no value), which on a GPU
stalls the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import posformer
from posformer.lit.callbacks import PEHeatmap, pe_figure, pe_modules
from posformer.model import ModelConfig, build_model
from posformer.model.positions import arange_positions
from posformer.pe import ENCODINGS, build_encoding
from posformer.pe.probe import position_logits
from tests.cli_cases import TINY_DATA, TINY_MODEL, TINY_TRAINING

PES = posformer.list_encodings()


@contextmanager
def foreign_default_device() -> Iterator[None]:
    """Inside: a tensor made without a device is on ``meta``, so it cannot meet a CPU tensor."""
    with torch.device("meta"):
        yield


def test_the_guard_catches_a_tensor_made_without_a_device() -> None:
    """The mechanism itself: what would be a CPU tensor meeting cuda:0 is a meta tensor meeting the CPU."""
    x = torch.ones(3)
    with foreign_default_device(), pytest.raises(RuntimeError, match="device"):
        _ = x + torch.arange(3)
    with foreign_default_device():
        assert (x + torch.arange(3, device=x.device)).device.type == "cpu"


def causal_only(pe: str) -> bool:
    return ENCODINGS[pe].causal_only


def model_config(pe: str, kind: str, **overrides: Any) -> ModelConfig:
    """A 2-layer d_model 16 model; for the encoder-decoder the PE also in the encoder and cross-attention
    where it is defined there (causal-only PEs: decoder self-attention only)."""
    both = not causal_only(pe)
    cross = both and ENCODINGS[pe].capabilities.in_attention
    values: dict[str, Any] = dict(
        kind=kind,
        vocab_size=13,
        d_model=16,
        n_heads=2,
        n_layers=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=32,
        dropout=0.0,
        pe=pe,
        pe_apply={"encoder": both, "decoder": True, "cross": cross},
    )
    values.update(overrides)
    return ModelConfig(**values)


def model_for(pe: str, kind: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config(pe, kind, **overrides))


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 13, (batch, length), generator=torch.Generator().manual_seed(seed))


def padding(batch: int, length: int) -> torch.Tensor:
    """(B, T) bool, True for real tokens; the last row has 3 padded positions."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, -3:] = False
    return mask


# ------------------------------------------------------------------------------------ the model itself
@pytest.mark.parametrize("pe", PES)
def test_decoder_forward_backward_with_padding(pe: str) -> None:
    model = model_for(pe, "decoder").train()
    x, mask = ids(2, 10), padding(2, 10)
    with foreign_default_device():
        logits = model(x, attention_mask=mask)
        logits.float().logsumexp(-1).sum().backward()
    assert logits.device.type == "cpu" and torch.isfinite(logits).all()


@pytest.mark.parametrize("pe", PES)
def test_decoder_forward_backward_without_masks(pe: str) -> None:
    """Positions 0 … T-1 and nothing masked but causality: the backends padding rules out (the fused
    kernel, a PE's own shortcut such as Shaw's, which trains; the offset vector)."""
    model = model_for(pe, "decoder").train()
    x = ids(2, 10)
    with foreign_default_device():
        logits = model(x)
        logits.float().logsumexp(-1).sum().backward()
    assert logits.device.type == "cpu" and torch.isfinite(logits).all()


@pytest.mark.parametrize("pe", PES)
def test_encoder_decoder_self_and_cross_attention_forward_backward(pe: str) -> None:
    model = model_for(pe, "encoder_decoder").train()
    src, tgt, src_mask, tgt_mask = ids(2, 9, 1), ids(2, 7, 2), padding(2, 9), padding(2, 7)
    with foreign_default_device():
        logits = model(src, tgt, src_mask, tgt_mask)
        logits.float().logsumexp(-1).sum().backward()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("pe", PES)
def test_packed_rows_forward_backward(pe: str) -> None:
    model = model_for(pe, "decoder").train()
    x, segments = ids(2, 8), torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    with foreign_default_device():
        logits = model(x, segment_ids=segments)
        logits.sum().backward()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("pe", PES)
def test_cached_decoding_and_sampling(pe: str) -> None:
    from posformer.eval.decoding import generate

    model = model_for(pe, "decoder").eval()
    prompt, generator = ids(2, 4), torch.Generator().manual_seed(0)
    with foreign_default_device(), torch.no_grad():
        greedy = generate(model, prompt, 5)
        sampled = generate(model, prompt, 5, temperature=0.8, top_k=5, generator=generator)
    assert greedy.shape == sampled.shape == (2, 9)


@pytest.mark.parametrize("pe", [p for p in PES if not causal_only(p)])
def test_greedy_and_beam_translation(pe: str) -> None:
    from posformer.eval.decoding import beam_search, greedy_decode

    model = model_for(pe, "encoder_decoder").eval()
    src, mask = ids(2, 6), padding(2, 6)
    with foreign_default_device(), torch.no_grad():
        greedy = greedy_decode(model, src, mask, max_len=6)
        beams = beam_search(model, src, mask, beam_size=3, max_len=6)
    assert len(greedy) == len(beams) == 2


@pytest.mark.parametrize("pe", [p for p in PES if (f := ENCODINGS[p].capabilities.bias) and f.score_mod])
def test_flex_attention_forward(pe: str) -> None:
    """The FlexAttention backend (eager, no gradients on the CPU): score_mod and block mask."""
    from posformer.model.backends import flex

    if not flex.available():
        pytest.skip("this torch has no FlexAttention")
    from posformer.model.context import BackendPolicy

    model = model_for(pe, "decoder", attention_backend="flex").eval()
    model.attention_policy = BackendPolicy(choice="flex", flex_compiled=False)  # eager: quick on the CPU
    x, mask = ids(2, 10), padding(2, 10)
    with torch.no_grad():
        expected = model_for(pe, "decoder", attention_backend="sdpa").eval()(x, attention_mask=mask)
        with foreign_default_device():
            got = model(x, attention_mask=mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ PE inspection
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pe", PES)
def test_position_logits_and_heat_map_figure(pe: str, causal: bool) -> None:
    if causal_only(pe) and not causal:
        pytest.skip("causal-only PE")
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    module = build_encoding(pe, d_model=16, n_heads=2, causal=causal, n_layers=2)
    with foreign_default_device(), torch.no_grad():
        logits = position_logits(module, arange_positions(12, device="cpu"))
        fig = pe_figure(module, 12, device=torch.device("cpu"))
    plt.close(fig)
    assert logits.shape[-2:] == (12, 12) and logits.device.type == "cpu"


@pytest.mark.parametrize(
    "pe",  # ~0.5 s of figures each: sinusoidal, learned, rope, alibi stay fast (every PE's logits: above)
    [
        p if p in ("sinusoidal", "learned", "rope", "alibi") else pytest.param(p, marks=pytest.mark.slow)
        for p in PES
    ],
)
def test_inspection_tables_and_figures(pe: str, tmp_path: Path) -> None:
    from posformer.cli.inspect import compose_config, inspect_pe

    cfg = compose_config([f"pe={pe}", "model.d_model=16", "model.n_heads=2", "max_len=16", "device=cpu"])
    with foreign_default_device():
        result = inspect_pe(cfg, tmp_path)
    assert result["paths"] and all(Path(p).is_file() for p in result["paths"])


# ------------------------------------------------------------------------------------ Lightning
class _FakeTrainer:
    """What :class:`PEHeatmap` reads of a trainer, without a training loop."""

    is_global_zero = True
    global_step = 3
    loggers: list[Any] = []

    def __init__(self, root: Path) -> None:
        self.default_root_dir = str(root)


def lightning_module(pe: str, kind: str) -> Any:
    from posformer.lit.modules import module_class

    fields = dict(model_config(pe, kind).__dict__)
    torch.manual_seed(0)
    return module_class(kind)(fields, max_steps=10)


def batch_for(kind: str) -> dict[str, torch.Tensor]:
    labels = ids(2, 6, 3)
    labels[-1, -2:] = -100
    if kind == "decoder":
        return {"input_ids": ids(2, 6), "labels": labels, "attention_mask": padding(2, 6)}
    return {
        "src_ids": ids(2, 5),
        "src_mask": padding(2, 5),
        "tgt_ids": ids(2, 6),
        "tgt_mask": padding(2, 6),
        "labels": labels,
    }


@pytest.mark.parametrize(
    ("pe", "kind"),
    [  # encoder-decoder: a training step, an evaluation batch and three heat maps (1-2 s each); rope's
        # stays fast, and so does every PE's encoder-decoder forward/backward under the guard (above)
        pytest.param(pe, kind, marks=pytest.mark.slow if kind == "encoder_decoder" and pe != "rope" else ())
        for pe in PES
        for kind in ("decoder", "encoder_decoder")
    ],
)
def test_heat_map_callback_training_step_and_evaluation_batch(pe: str, kind: str, tmp_path: Path) -> None:
    module = lightning_module(pe, kind)
    batch = batch_for(kind)
    with foreign_default_device():
        PEHeatmap(length=8).draw(_FakeTrainer(tmp_path), module, "start")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, "log", lambda *a, **k: None)  # no trainer attached
            loss = module.training_step(batch, 0)
        loss.backward()
        stats = module.evaluate_batch(batch)
    assert torch.isfinite(loss) and float(stats["n_tokens"]) == 10
    saved = {p.name for p in tmp_path.glob("position_logits_*_start.png")}
    assert len(saved) == len(pe_modules(module))


@pytest.mark.parametrize("pe", PES)
def test_language_model_windows_and_task_scoring(pe: str) -> None:
    from posformer.eval.tasks import score_task_batch
    from posformer.eval.windows import score_lm_windows, sliding_windows

    model = model_for(pe, "decoder").eval()
    stream, batch = ids(1, 40)[0], batch_for("decoder")
    with foreign_default_device(), torch.no_grad():
        lm = score_lm_windows(model, stream, sliding_windows(39, 12, 6), batch=3, curve_len=12)
        task = score_task_batch(model, batch)
    assert lm["scored_tokens"] > 0 and task["n_tokens"] == 10


# ------------------------------------------------------------------------------------ no host sync
@pytest.mark.parametrize("pe", PES)
def test_training_step_on_the_meta_device_makes_no_host_sync(pe: str) -> None:
    """A training step (forward, loss, backward) with the whole model on ``meta``: no tensor made on
    the CPU, and no host read of a device value (``int(t)``, ``.item()``: a meta tensor has none)."""
    model = model_for(pe, "decoder").train().to("meta")
    x = torch.zeros(2, 10, dtype=torch.long, device="meta")
    with foreign_default_device():
        logits = model(x)
        logits.float().logsumexp(-1).sum().backward()
    assert logits.device.type == "meta"


# ------------------------------------------------------------------------------------ end to end
def _guarded(fn: Any) -> Any:
    """``fn`` run under :func:`foreign_default_device`."""

    def inner(*args: Any, **kwargs: Any) -> Any:
        with foreign_default_device():
            return fn(*args, **kwargs)

    return inner


@pytest.mark.parametrize(
    "overrides",
    [  # a whole training run each (2-6 s): alibi stays in the fast set
        [*TINY_MODEL, "pe=alibi"],
        pytest.param([*TINY_MODEL, "pe=forget_alibi", "data.pack=true"], marks=pytest.mark.slow),
        pytest.param(
            [
                "model=encdec_tiny",
                "model.d_model=16",
                "model.n_heads=2",
                "pe=t5",
                "model.pe_apply.cross=true",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["alibi", "forget_alibi-packed", "t5-encdec"],
)
def test_a_training_run_with_its_default_heat_maps_under_the_guard(
    overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``posformer-train``'s whole flow (heat maps on, training, validation, final evaluation), with every
    model forward, every evaluation batch and the heat-map callback under the guard (Lightning's own
    bookkeeping outside it: ``self.log`` makes its tensors without a device on purpose)."""
    from hydra import compose, initialize_config_module

    from posformer.cli.train import run
    from posformer.lit.modules import PosformerModule

    for name in ("logits", "evaluate_batch"):
        monkeypatch.setattr(PosformerModule, name, _guarded(getattr(PosformerModule, name)))
    monkeypatch.setattr(PEHeatmap, "draw", _guarded(PEHeatmap.draw))
    run_dir = tmp_path / "run"
    args = [
        *TINY_DATA,
        *TINY_TRAINING,
        *overrides,
        "logger=tensorboard",
        "trainer=cpu",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={run_dir}",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=args)
    run(cfg)
    assert (run_dir / "results.json").is_file()
    assert list(run_dir.glob("position_logits_*_start.png"))
    # the end-of-training map is drawn (under the guard) for a PE with parameters; a parameter-free
    # PE's map does not change, so the callback draws it once
    pe = build_encoding(str(cfg.model.pe), d_model=16, n_heads=2, causal=True)
    assert bool(list(run_dir.glob("position_logits_*_end.png"))) == any(True for _ in pe.parameters())

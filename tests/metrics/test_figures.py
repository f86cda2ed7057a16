"""Figures fit for a paper: one colour per PE, units on the axes, ticks at the evaluated lengths,
fractions on [0, 1], ± std bands only over several seeds, the legend outside the data, PNG + SVG;
one TensorBoard run per model with shared tags; PE heat maps at the start and end of training,
masked where causal attention never looks, sent to every logger that takes images."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from posformer.eval.plots import _group_lines, log_scalars, tensorboard_writer, write_plots  # noqa: E402
from posformer.eval.store import Results  # noqa: E402
from posformer.lit.callbacks import PEHeatmap, pe_figure  # noqa: E402
from posformer.pe import ENCODINGS, build_encoding  # noqa: E402
from posformer.utils.figures import (  # noqa: E402
    Line,
    draw_lines,
    length_axis,
    log_ticks,
    metric_axis,
    pe_color,
    pe_marker,
    zoom_panel,
)


def _rows() -> list[dict]:
    rows = []
    for pe, seeds, ems in (("rope", (0, 1), (1.0, 0.5, 0.1)), ("alibi", (0,), (1.0, 0.9, 0.8))):
        for seed in seeds:
            for length, em in zip((8, 16, 32), ems, strict=True):
                rows.append(
                    {
                        "key": f"{pe}{seed}{length}",
                        "series": f"{pe} · seed {seed}",
                        "pe": pe,
                        "status": "ok",
                        "task_type": "task",
                        "mode": "task",
                        "length": length,
                        "train_len": 8,
                        "exact_match": em - 0.1 * seed,
                        "token_acc": em,
                        "loss": 1.0,
                    }
                )
    return rows


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """sRGB -> CIELAB (D65)."""
    from matplotlib.colors import to_rgb

    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(hex_colour)]
    rows = ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))
    xyz = [
        sum(m * c for m, c in zip(row, lin, strict=True)) / w
        for row, w in zip(rows, (0.95047, 1, 1.08883), strict=True)
    ]
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_one_colour_per_pe_from_the_registry():
    colours = [pe_color(name) for name in ENCODINGS]
    assert len(set(colours)) == len(colours)  # every registered PE its own colour
    # ... that can be told apart: no two closer than ΔE76 = 20 (tab10 + Dark2 had 14.4: two oranges)
    closest = min(math.dist(_lab(a), _lab(b)) for a, b in itertools.combinations(colours, 2))
    assert closest >= 20, closest
    assert pe_color("rope") == pe_color("rope") and pe_color("my.module:MyPE") == pe_color("my.module:MyPE")


def test_rope_and_sinusoidal_differ_in_hue_and_each_pe_keeps_its_marker():
    import colorsys

    from matplotlib.colors import to_rgb

    hue = {pe: colorsys.rgb_to_hls(*to_rgb(pe_color(pe))) for pe in ("rope", "sinusoidal")}
    assert math.dist(_lab(pe_color("rope")), _lab(pe_color("sinusoidal"))) >= 40
    assert abs(hue["rope"][1] - hue["sinusoidal"][1]) > 0.3  # lightness: black vs magenta
    assert len({pe_marker(n) for n in ENCODINGS}) == len(ENCODINGS)
    fig, ax = plt.subplots()
    draw_lines(ax, [Line("x", "alibi", [1, 2], [1, 2]), Line("rope · seed 0", "rope", [1, 2], [2, 3])])
    other, axb = plt.subplots()
    draw_lines(axb, [Line("rope", "rope", [1, 2], [2, 3])])  # another figure, another position
    assert ax.get_lines()[1].get_marker() == axb.get_lines()[0].get_marker() == pe_marker("rope")
    plt.close(fig), plt.close(other)


@pytest.mark.parametrize(
    ("lo", "hi", "expected"), [(8.5, 15, [9, 10, 12, 15]), (1.8, 55, [2, 3, 5, 10, 20, 30, 50])]
)
def test_log_ticks_are_readable(lo, hi, expected):
    fig, ax = plt.subplots()
    ax.plot([1, 2], [lo, hi])
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    log_ticks(ax)
    assert [float(t) for t in ax.get_yticks() if lo <= t <= hi] == expected
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels() if t.get_text()] == [f"{v:g}" for v in expected]
    plt.close(fig)


def test_zoom_panel_only_where_curves_bunch():
    flat = Line("alibi", "alibi", [32, 64, 128], [1.95, 1.9, 1.88])
    climb = Line("rope", "rope", [32, 64, 128], [1.93, 9.0, 28.0])
    fig, ax = plt.subplots()
    draw_lines(ax, [flat, climb])
    zoom = zoom_panel(ax, [flat, climb], "ppl")
    assert zoom is not None and zoom.get_ylim()[1] < 2.5 and ax.get_xlabel() == ""
    plt.close(fig)
    fig, ax = plt.subplots()
    apart = Line("rope", "rope", [32, 64], [5.0, 6.0])
    assert zoom_panel(ax, [flat, apart], "ppl") is None  # nothing bunches: no panel
    assert zoom_panel(ax, [flat, climb], "exact_match") is None  # fractions are on [0, 1] already
    plt.close(fig)


def test_axes_follow_the_conventions():
    lines = _group_lines(_rows(), "exact_match")
    rope, alibi = lines
    assert (rope.label, rope.n_seeds, alibi.n_seeds) == ("rope", 2, 1)  # seeds averaged, not one line each
    assert rope.y[2] == pytest.approx(0.05) and rope.std[2] == pytest.approx(0.0707, abs=1e-3)
    fig, ax = plt.subplots()
    draw_lines(ax, [*lines, Line("rope +yarn", "rope", rope.x, rope.y)])
    length_axis(ax, [8, 16, 32], [8])
    metric_axis(ax, "exact_match")
    assert list(ax.get_xticks()) == [8, 16, 32] and [t.get_text() for t in ax.get_xticklabels()] == [
        "8",
        "16",
        "32",
    ]
    assert ax.get_ylim() == pytest.approx((-0.02, 1.02)) and "fraction" in ax.get_ylabel()
    assert "tokens" in ax.get_xlabel()
    assert len(ax.collections) == 1  # a ± band for the 2-seed line only
    drawn = [ln for ln in ax.get_lines() if ln.get_label() in ("rope (n=2)", "rope +yarn")]
    assert drawn[0].get_color() == drawn[1].get_color() == pe_color("rope")  # same PE, same colour
    assert drawn[0].get_linestyle() != drawn[1].get_linestyle()  # ... but a coinciding line stays visible
    plt.close(fig)


def test_write_plots_png_svg_legend_outside(tmp_path, monkeypatch):
    saved = []
    real = plt.Figure.savefig
    monkeypatch.setattr(
        plt.Figure, "savefig", lambda self, *a, **k: (saved.append(self), real(self, *a, **k))[1]
    )
    paths = write_plots(Results(rows=_rows()), tmp_path)
    assert [p.name for p in paths] == ["extrapolation_exact_match.png", "extrapolation_token_acc.png"]
    for p in paths:
        assert p.read_bytes()[:4] == b"\x89PNG" and p.with_suffix(".svg").read_text().lstrip().startswith(
            "<?xml"
        )
    fig = saved[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    legend, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= box.x1  # right of the axes: never over the data
    assert "training length 8" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_written_figures_are_byte_reproducible(tmp_path):
    """The same data written twice gives the same PNG and SVG bytes, so committed figures change
    only with their content (the SVG carries no date and no random element ids)."""
    first = write_plots(Results(rows=_rows()), tmp_path / "a")
    second = write_plots(Results(rows=_rows()), tmp_path / "b")
    for a, b in zip(first, second, strict=True):
        for suffix in (".png", ".svg"):
            assert a.with_suffix(suffix).read_bytes() == b.with_suffix(suffix).read_bytes(), suffix


def test_tensorboard_one_run_per_model_with_shared_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard_writer(tmp_path)
    log_scalars(Results(rows=_rows()), writer)
    writer.close()
    runs = sorted(p.name for p in (tmp_path / "tensorboard").iterdir() if p.is_dir())
    assert runs == ["alibi-seed-0", "rope-seed-0", "rope-seed-1"]
    tags = []
    for run in runs:
        acc = EventAccumulator(str(tmp_path / "tensorboard" / run))
        acc.Reload()
        tags.append(set(acc.Tags()["scalars"]))
        assert [e.step for e in acc.Scalars("eval/exact_match/task")] == [8, 16, 32]
    assert tags[0] == tags[1] == tags[2]  # the same tags: the curves overlay in one chart


def test_heatmap_masks_the_causal_triangle_and_titles():
    pe = build_encoding("alibi", d_model=16, n_heads=2, causal=True)
    fig = pe_figure(pe, 8, title="alibi PE, self-attention")
    image = fig.axes[0].get_images()[0]
    data = image.get_array()
    assert bool(data.mask[0, 1]) and not bool(data.mask[1, 0])  # key after the query: blank
    lo, hi = image.get_clim()  # diverging, centred at 0, sized by the visible (past) cells only
    visible = data.compressed()
    assert lo == -hi and hi == pytest.approx(float(abs(visible).max()))
    assert image.get_cmap().name.startswith("RdBu_r")
    assert fig.get_suptitle() == "alibi PE, self-attention" and fig.axes[0].get_title() == "head 1 of 2"
    assert fig.axes[-1].get_ylabel() == "bias added to the logit q·k/√Dh"
    plt.close(fig)
    labels = {}
    for name in ("rope", "sinusoidal", "nope"):
        fig = pe_figure(build_encoding(name, d_model=16, n_heads=2, causal=True), 8)
        labels[name] = fig.axes[-1].get_ylabel()
        plt.close(fig)
    assert labels == {  # by the declared hook: a rotary PE adds nothing to q·k
        "rope": "logit q·k/√Dh of all-ones q, k after rotation",
        "sinusoidal": "PE(i)·PE(j)/√D (added to the input)",
        "nope": "no positional term (zero)",
    }
    fig = pe_figure(build_encoding("alibi", d_model=16, n_heads=2, causal=False), 8)
    assert not fig.axes[0].get_images()[0].get_array().mask.any()  # bidirectional: nothing hidden
    plt.close(fig)


class _ImageLogger:  # a logger with its own image API (Weights & Biases style)
    def __init__(self):
        self.calls = []

    def log_image(self, key, images, step):
        self.calls.append((key, step, images[0].shape[-1]))


class _Board:  # a TensorBoard-style experiment
    def __init__(self):
        self.calls = []

    def add_figure(self, tag, fig, global_step, close):
        self.calls.append((tag, global_step))


def test_heatmap_start_and_end_to_every_image_logger(tmp_path, tiny_model):
    model = tiny_model("learned")
    module = torch.nn.Module()
    module.model = model
    image_logger, board = _ImageLogger(), _Board()
    csv_like = SimpleNamespace(experiment=SimpleNamespace())  # no images: skipped
    loggers = [image_logger, SimpleNamespace(experiment=board), csv_like]
    trainer = SimpleNamespace(
        is_global_zero=True, global_step=0, loggers=loggers, default_root_dir=str(tmp_path)
    )
    cb = PEHeatmap(length=8, max_heads=2)
    cb.on_train_start(trainer, module)
    with torch.no_grad():  # "training" changes the learned table
        for p in model.pe.parameters():
            p.add_(torch.randn_like(p))
    trainer.global_step = 5
    cb.on_train_end(trainer, module)
    assert image_logger.calls == [
        ("position_logits/self-attention", 0, 3),
        ("position_logits/self-attention", 5, 3),
    ]
    assert board.calls == [("position_logits/self-attention", 0), ("position_logits/self-attention", 5)]
    start, end = (Path(tmp_path) / f"position_logits_pe_{w}.png" for w in ("start", "end"))
    assert start.read_bytes()[:4] == b"\x89PNG" and end.with_suffix(".svg").exists()
    assert start.read_bytes() != end.read_bytes()  # the trained values, not the initial ones twice


def test_a_parameter_free_pe_is_drawn_once(tmp_path, tiny_model):
    module = torch.nn.Module()
    module.model = tiny_model("alibi")
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, loggers=[], default_root_dir=str(tmp_path))
    cb = PEHeatmap(length=8, max_heads=2)
    cb.on_train_start(trainer, module)
    trainer.global_step = 5
    cb.on_train_end(trainer, module)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["position_logits_pe_start.png"]

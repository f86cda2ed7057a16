"""The length-extrapolation harness on tiny models trained in the test (CPU, seconds)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from posformer.checkpoints import find_checkpoints, load_checkpoint
from posformer.errors import CheckpointError, ConfigError
from posformer.eval.harness import evaluate_subjects
from posformer.eval.scaling import resolve_scaling, set_rope_scaling
from posformer.eval.settings import EvalSettings, Subject
from posformer.eval.store import Results
from posformer.eval.tasks import score_task_batch
from posformer.eval.windows import nonoverlap_windows, sliding_windows
from posformer.model import ModelConfig, build_model
from posformer.utils.memory import MemoryMeter

TRAIN_LEN = 16
VOCAB = 11


def make_stream(n: int, seed: int) -> torch.Tensor:
    """A learnable stream: counting mod 7 in tokens 4..10, with a random restart every ~10 tokens."""
    g = torch.Generator().manual_seed(seed)
    out, cur = [], 0
    for _ in range(n):
        if torch.rand(1, generator=g).item() < 0.1:
            cur = int(torch.randint(0, 7, (1,), generator=g))
        out.append(4 + cur)
        cur = (cur + 1) % 7
    return torch.tensor(out)


def train_tiny(pe: str, steps: int = 120, **pe_options) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=VOCAB,
        d_model=32,
        n_heads=2,
        n_layers=1,
        d_ff=64,
        dropout=0.0,
        pe=pe,
        pe_options=pe_options,
    )
    model = build_model(cfg)
    stream = make_stream(4000, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - TRAIN_LEN - 1, (16,), generator=g)
        idx = starts.unsqueeze(1) + torch.arange(TRAIN_LEN + 1)
        tok = stream[idx]
        loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster, and robust to a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def alibi_model():
    return train_tiny("alibi")


@pytest.fixture(scope="module")
def eval_stream():
    return make_stream(2 * 64 * 4 + 1, seed=2)


def settings(**kw) -> EvalSettings:
    base = dict(lengths=[16, 32, 64], n_tokens=256, batch_tokens=256, progress=False)
    base.update(kw)
    return EvalSettings(**base)


def run(subjects, s, out, **kw):
    return evaluate_subjects(subjects, s, out, tensorboard=kw.pop("tensorboard", False), **kw)


# ------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize("n,L,S", [(256, 64, 32), (250, 64, 24), (100, 16, 16), (10, 64, 8), (97, 10, 3)])
def test_windows_score_every_target_once(n, L, S):
    for windows in (nonoverlap_windows(n, L), sliding_windows(n, L, S)):
        scored = []
        for w in windows:
            assert 0 < w.n_scored <= w.length <= L and w.start >= 0
            first = w.start + w.length - w.n_scored + 1  # targets are stream[start + 1 : start + length + 1]
            scored += list(range(first, w.start + w.length + 1))
        assert scored == list(range(1, n + 1))


def test_sliding_first_window_scores_all_later_only_stride():
    ws = sliding_windows(100, 40, 10)
    assert (ws[0].start, ws[0].n_scored) == (0, 40)
    assert all(w.length == 40 and w.n_scored == 10 for w in ws[1:])
    assert [w.start for w in ws] == [0, 10, 20, 30, 40, 50, 60]


def test_sliding_with_stride_equal_length_is_nonoverlap():
    assert sliding_windows(256, 32, 32) == nonoverlap_windows(256, 32)


# ------------------------------------------------------------------------------------------- LM harness
def direct_loss(model, stream: torch.Tensor, L: int, n: int) -> float:
    """Mean next-token loss over consecutive length-L chunks of stream[: n + 1] (the validation loss)."""
    tok = stream[: n + 1]
    x, y = tok[:-1].view(-1, L), tok[1:].view(-1, L)
    with torch.no_grad():
        return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def test_lm_harness_outputs_agree(alibi_model, eval_stream, tmp_path):
    subj = Subject(
        "alibi", alibi_model, "lm", eval_stream, train_len=TRAIN_LEN, checkpoint="a.ckpt", pe="alibi"
    )
    res = run([subj], settings(), tmp_path, tensorboard=True)
    for name in (
        "extrapolation.json",
        "extrapolation.csv",
        "extrapolation.md",
        "extrapolation_ppl_nonoverlap.png",
        "extrapolation_ppl_sliding.png",
        "extrapolation_position_loss.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert list((tmp_path / "tensorboard").glob("events.*"))
    rows = json.loads((tmp_path / "extrapolation.json").read_text())["results"]
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    # same number of scored tokens at every length, in both modes
    assert {r["scored_tokens"] for r in rows} == {256}
    with open(tmp_path / "extrapolation.csv") as f:
        csv_rows = list(csv.DictReader(f))
    md = (tmp_path / "extrapolation.md").read_text()
    assert "256" in md and "16*" in md  # scored tokens stated; training length marked
    for r, c in zip(rows, csv_rows):
        assert (c["mode"], int(c["length"])) == (r["mode"], r["length"])
        assert float(c["loss"]) == pytest.approx(r["loss"], rel=1e-12)
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert f"{r['ppl']:.3f} ({r['loss']:.3f})" in md
        assert r["in_distribution"] == (r["length"] <= TRAIN_LEN)
        assert r["peak_mem_mb"] > 0
    assert res.rows == rows
    # the per-position curve averages to the loss (nonoverlap chunks all have length L)
    for r in rows:
        if r["mode"] == "nonoverlap":
            assert len(r["position_loss"]) == r["length"]
            assert sum(r["position_loss"]) / r["length"] == pytest.approx(r["loss"], abs=1e-4)


def test_nonoverlap_at_train_length_is_validation_loss(alibi_model, eval_stream, tmp_path):
    subj = Subject("alibi", alibi_model, "lm", eval_stream, train_len=TRAIN_LEN)
    res = run([subj], settings(lengths=[TRAIN_LEN, 64], modes=("nonoverlap",)), tmp_path, plots=False)
    by_len = {r["length"]: r for r in res.rows}
    assert by_len[TRAIN_LEN]["loss"] == pytest.approx(
        direct_loss(alibi_model, eval_stream, TRAIN_LEN, 256), rel=1e-5
    )
    assert by_len[64]["loss"] == pytest.approx(direct_loss(alibi_model, eval_stream, 64, 256), rel=1e-5)
    assert by_len[TRAIN_LEN]["loss"] < 0.9 * math.log(VOCAB)  # the model learned something


def test_sliding_with_stride_equal_length_equals_nonoverlap(alibi_model, eval_stream, tmp_path):
    subj = Subject("alibi", alibi_model, "lm", eval_stream, train_len=TRAIN_LEN)
    res = run([subj], settings(stride=1.0), tmp_path, plots=False)
    loss = {(r["mode"], r["length"]): r["loss"] for r in res.rows}
    for L in (16, 32, 64):
        assert loss[("sliding", L)] == pytest.approx(loss[("nonoverlap", L)], rel=1e-6)
    # a smaller stride scores the same tokens with more context: a different number
    res2 = run([subj], settings(stride=4, lengths=[16]), tmp_path / "s4", plots=False)
    sl = next(r for r in res2.rows if r["mode"] == "sliding")
    assert sl["scored_tokens"] == 256 and sl["n_sequences"] == 1 + (256 - 16) // 4
    assert sl["loss"] != pytest.approx(loss[("nonoverlap", 16)], rel=1e-6)


def test_learned_pe_reports_na_past_its_table(eval_stream, tmp_path):
    model = train_tiny("learned", steps=20, max_len=32)
    subj = Subject("learned", model, "lm", eval_stream, train_len=TRAIN_LEN, pe="learned")
    res = run([subj], settings(), tmp_path)
    status = {(r["mode"], r["length"]): r for r in res.rows}
    for mode in ("nonoverlap", "sliding"):
        assert status[(mode, 32)]["status"] == "ok"
        na = status[(mode, 64)]
        assert na["status"] == "n/a" and "max_len=32" in na["reason"] and na.get("loss") is None
    md = (tmp_path / "extrapolation.md").read_text()
    assert "n/a" in md and "max_len=32" in md


def test_rerun_skips_done_pairs(alibi_model, eval_stream, tmp_path):
    calls = []
    handle = alibi_model.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    try:
        subj = Subject("alibi", alibi_model, "lm", eval_stream, train_len=TRAIN_LEN, checkpoint="x.ckpt")
        first = run([subj], settings(lengths=[16, 32]), tmp_path, plots=False)
        n_first = len(calls)
        assert n_first > 0
        again = run([subj], settings(lengths=[16, 32]), tmp_path, plots=False)
        assert len(calls) == n_first  # nothing re-evaluated
        assert again.meta["skipped_pairs"] == 4
        assert [r["loss"] for r in again.rows] == [r["loss"] for r in first.rows]
        more = run([subj], settings(lengths=[16, 32, 64]), tmp_path, plots=False)
        assert {s[1] for s in calls[n_first:]} == {64}  # only the new length ran
        assert len(more.rows) == 6
    finally:
        handle.remove()
    # an interrupted run leaves a loadable partial file
    assert len(Results.load(tmp_path).done_keys()) == 6


def test_memory_meter_sees_an_allocation():
    with MemoryMeter(torch.device("cpu")) as m:
        x = torch.ones(64, 2**20)  # 256 MiB
        x += 1
    assert m.delta_mb >= 200 and m.peak_mb >= m.delta_mb


# ------------------------------------------------------------------------------ rope scaling at eval
def test_eval_rope_scaling_override(eval_stream, tmp_path):
    model = train_tiny("rope", steps=30)
    pe = model.pe
    x = torch.randint(4, VOCAB, (1, 64))
    with torch.no_grad():
        base = model(x)
        assert set_rope_scaling(model, {"type": "linear", "factor": 4.0}) == 1
        scaled = model(x)
    assert pe.scaling == {"type": "linear", "factor": 4.0}
    assert not torch.allclose(base, scaled)
    set_rope_scaling(model, None)
    with torch.no_grad():
        assert torch.allclose(model(x), base)
    assert resolve_scaling({"type": "yarn", "factor": "auto"}, 64, 16) == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_len": 16,
    }
    assert resolve_scaling({"type": "yarn", "factor": "auto"}, 8, 16)["factor"] == 1.0
    with pytest.raises(ConfigError, match="scaling.type"):
        set_rope_scaling(model, {"type": "bogus", "factor": 2})
    subj = Subject(
        "rope",
        model,
        "lm",
        eval_stream,
        train_len=TRAIN_LEN,
        pe="rope",
        scaling={"type": "linear", "factor": "auto"},
    )
    plain = Subject("rope", model, "lm", eval_stream, train_len=TRAIN_LEN, pe="rope")
    res = run([plain, subj], settings(modes=("nonoverlap",)), tmp_path, plots=False)
    loss = {(r["scaling"], r["length"]): r["loss"] for r in res.rows}
    assert loss[("linear(factor=auto)", 16)] == pytest.approx(
        loss[("none", 16)], rel=1e-6
    )  # factor 1 at L=16
    assert loss[("linear(factor=auto)", 64)] != loss[("none", 64)]


# ------------------------------------------------------------------------------------------- tasks
class FakeTaskData:
    """eval_dataloaders(lengths) over fixed batches; the labels copy the predictions in half the rows."""

    def __init__(self, model):
        self.batches = {}
        g = torch.Generator().manual_seed(0)
        for L in (4, 8):
            ids = torch.randint(4, VOCAB, (4, L), generator=g)
            with torch.no_grad():
                pred = model(ids).argmax(-1)
            labels = torch.full_like(ids, -100)
            labels[:, L // 2 :] = pred[:, L // 2 :]
            labels[2:, -1] = (pred[2:, -1] + 1) % VOCAB  # rows 2, 3: last token wrong
            self.batches[L] = [
                {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids).bool()}
            ]

    def eval_dataloaders(self, lengths):
        return {L: self.batches[L] for L in lengths if L in self.batches}


def test_task_metrics(alibi_model, tmp_path):
    data = FakeTaskData(alibi_model)
    stats = score_task_batch(alibi_model, data.batches[8][0])
    assert (stats["n_exact"], stats["n_sequences"], stats["n_tokens"], stats["n_correct_tokens"]) == (
        2,
        4,
        16,
        14,
    )
    subj = Subject("alibi", alibi_model, "task", data, train_len=(2, 4), checkpoint="t.ckpt")
    res = run([subj], settings(lengths=[4, 8, 16]), tmp_path)
    by_len = {r["length"]: r for r in res.rows}
    assert by_len[4]["exact_match"] == 0.5 and by_len[8]["token_acc"] == pytest.approx(14 / 16)
    assert by_len[4]["in_distribution"] is True and by_len[8]["in_distribution"] is False
    assert by_len[16]["status"] == "n/a"
    assert (tmp_path / "extrapolation_exact_match.png").exists()
    assert "4*" in (tmp_path / "extrapolation.md").read_text()


def test_task_rows_read_the_device_once_per_length(alibi_model, tmp_path, monkeypatch):
    """The task rows add each batch's sums on the device and read them once per length (on a GPU a
    read per batch would wait for every batch): no host read while a batch is scored, one
    ``read_totals`` per length, and the row equals the batches' sums read one by one."""
    from torch.overrides import TorchFunctionMode

    import posformer.eval.harness as harness

    class HostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu"):
                found.append(func.__name__)
            return func(*args, **(kwargs or {}))

    found, reads = [], []
    sums, read = harness.task_batch_sums, harness.read_totals

    def scored_without_reads(model, batch, positions=None):
        with HostReads():
            return sums(model, batch, positions)

    monkeypatch.setattr(harness, "task_batch_sums", scored_without_reads)
    monkeypatch.setattr(harness, "read_totals", lambda s: (reads.append(1), read(s))[1])
    data = FakeTaskData(alibi_model)
    data.batches = {L: batches * 3 for L, batches in data.batches.items()}  # 3 batches a length
    subj = Subject("alibi", alibi_model, "task", data, train_len=(2, 4), checkpoint="t.ckpt")
    rows = {r["length"]: r for r in run([subj], settings(lengths=[4, 8]), tmp_path).rows}
    assert not found and len(reads) == 2
    for L, batches in data.batches.items():
        one = [score_task_batch(alibi_model, b) for b in batches]
        assert rows[L]["scored_tokens"] == sum(x["n_tokens"] for x in one)
        assert rows[L]["loss"] == sum(x["loss_sum"] for x in one) / rows[L]["scored_tokens"]


@pytest.mark.slow
def test_task_metrics_with_randomized_positions(alibi_model, tmp_path, read_extrapolate):
    """eval.task_positions=[ordinary, randomized]: the ordinary rows are unchanged; the randomized rows
    (mode task_randomized) score each batch with sorted random subsets of [0, n_max) from a generator
    seeded per length, so they are reproducible; without n_max they are n/a, saying why."""
    from posformer.model.positions import randomized_positions

    data = FakeTaskData(alibi_model)
    both = settings(lengths=[4, 8], task_positions=("ordinary", "randomized"), positions_seed=3)
    subj = Subject("alibi", alibi_model, "task", data, train_len=(2, 4), checkpoint="t.ckpt", n_max=64)
    rows = {(r["mode"], r["length"]): r for r in run([subj], both, tmp_path / "a").rows}
    plain = {r["length"]: r for r in run([subj], settings(lengths=[4, 8]), tmp_path / "b").rows}
    for L in (4, 8):
        assert rows[("task", L)]["token_acc"] == plain[L]["token_acc"]
        rnd = rows[("task_randomized", L)]
        assert rnd["series"] == "alibi [randomized positions]" and rnd["status"] == "ok"
        batch = data.batches[L][0]
        pos = randomized_positions(4, L, 64, generator=torch.Generator().manual_seed(3))
        assert pos.max() > L  # not 0 … L-1
        direct = score_task_batch(alibi_model, batch, positions=pos)
        assert rnd["token_acc"] == direct["n_correct_tokens"] / direct["n_tokens"]
    again = {(r["mode"], r["length"]): r for r in run([subj], both, tmp_path / "c").rows}
    assert again[("task_randomized", 8)]["loss"] == rows[("task_randomized", 8)]["loss"]
    no_range = Subject("alibi", alibi_model, "task", data, train_len=(2, 4), checkpoint="u.ckpt")
    na = [r for r in run([no_range], both, tmp_path / "d").rows if r["mode"] == "task_randomized"]
    assert {r["status"] for r in na} == {"n/a"} and "positions.n_max" in na[0]["reason"]
    with pytest.raises(ConfigError, match="eval.task_positions"):
        read_extrapolate(task_positions=["shuffled"])


# ------------------------------------------------------------------------------------------- checkpoints
def save_ckpt(model, path, best=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt = {
        "hyper_parameters": {"model": model.cfg.to_dict(), "data": {"name": "tiny", "train_len": TRAIN_LEN}},
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
    }
    if best is not None:
        ckpt["callbacks"] = {"ModelCheckpoint{'monitor': 'val/loss'}": {"best_model_path": str(best)}}
    torch.save(ckpt, path)


def test_load_and_find_checkpoints(alibi_model, tmp_path):
    run_a = tmp_path / "multirun" / "0_pe=alibi" / "checkpoints"
    save_ckpt(alibi_model, run_a / "step000100-val_loss1.0.ckpt")
    save_ckpt(alibi_model, run_a / "step000200-val_loss2.0.ckpt")
    save_ckpt(alibi_model, run_a / "last.ckpt", best=run_a / "step000100-val_loss1.0.ckpt")
    run_b = tmp_path / "multirun" / "1_pe=rope" / "checkpoints"
    save_ckpt(alibi_model, run_b / "last.ckpt")
    best = find_checkpoints(tmp_path / "multirun", "best")
    assert [p.name for p in best] == ["step000100-val_loss1.0.ckpt", "last.ckpt"]
    assert [p.name for p in find_checkpoints(tmp_path / "multirun", "last")] == ["last.ckpt", "last.ckpt"]
    ck = load_checkpoint(best[0])
    assert ck.pe == "alibi" and ck.train_len == TRAIN_LEN
    x = torch.randint(4, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(ck.model(x), alibi_model(x))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.ckpt")
    (tmp_path / "none_here").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints"):
        find_checkpoints(tmp_path / "none_here", "best")


def test_settings_validation(read_extrapolate):
    with pytest.raises(ConfigError, match="eval.stride"):
        read_extrapolate(stride=0)
    with pytest.raises(ConfigError, match="eval.modes"):
        EvalSettings(lengths=[8], modes=("both",))
    with pytest.raises(ConfigError, match="eval.lengths"):
        EvalSettings(lengths=[])
    assert EvalSettings(lengths=[64], stride=0.25).stride_for(64) == 16
    assert EvalSettings(lengths=[64], stride=100).stride_for(64) == 64


# ------------------------------------------------------------------------------ posformer-eval end to end
def test_posformer_eval_on_a_training_run_dir(tmp_path):
    """A run dir as posformer-train leaves it (checkpoints/ + config.yaml): posformer-eval's config path,
    the data rebuilt from the run's config, and nonoverlap at the training length == the validation loss."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from posformer.data import build_datamodule
    from posformer.eval.run import run_extrapolation
    from posformer.eval.settings import read_eval
    from posformer.lit import LanguageModelModule

    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i % 13}: to be or not to be, that is the question.\n" for i in range(80)))
    data_cfg = {
        "name": "text",
        "path": str(text),
        "block_size": 16,
        "cache_dir": str(tmp_path / "cache"),
        "val_fraction": 0.2,
        "batch_size": 8,
    }
    dm = build_datamodule(data_cfg, "decoder", 0)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(0)
    fields = ModelConfig(
        kind="decoder",
        vocab_size=dm.vocab_size,
        d_model=32,
        n_heads=2,
        n_layers=1,
        d_ff=64,
        dropout=0.0,
        pe="rope",
    ).to_dict()
    module = LanguageModelModule(model=fields, data={"task_type": "lm", "train_length": 16}).eval()
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(
        {"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()},
        run_dir / "checkpoints" / "last.ckpt",
    )
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml({"seed": 0, "data": data_cfg}))

    # the validation loss as training computes it
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in dm.val_dataloader():
        stats = module.evaluate_batch(batch)
        totals += torch.stack([stats["loss_sum"], stats["n_tokens"]])
    val_loss, val_tokens = float(totals[0] / totals[1]), int(totals[1])

    out = tmp_path / "eval"
    overrides = [
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={out}",
        f"eval.sweep_dir={tmp_path}",
        "eval.lengths=[16,32]",
        f"eval.n_tokens={val_tokens}",
        f"eval.output_dir={out}",
        "eval.progress=false",
        "eval.tensorboard=false",
        "eval.rope_scaling=[null,{type:yarn,factor:2}]",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    res = run_extrapolation(read_eval(cfg, "extrapolate"))
    rows = {(r["scaling"], r["mode"], r["length"]): r for r in res.rows}
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows.values())
    assert rows[("none", "nonoverlap", 16)]["loss"] == pytest.approx(val_loss, rel=1e-5)
    assert rows[("none", "nonoverlap", 16)]["scored_tokens"] == val_tokens
    assert rows[("none", "nonoverlap", 16)]["train_len"] == 16
    # yarn's original_max_len defaults to the training length; at 2x the model output changes
    assert rows[("yarn(factor=2)", "nonoverlap", 32)]["loss"] != rows[("none", "nonoverlap", 32)]["loss"]
    assert (out / "extrapolation.md").exists() and (out / "extrapolation_ppl_sliding.png").exists()


def test_rewritten_checkpoint_is_evaluated_again(alibi_model, eval_stream, tmp_path):
    """``last.ckpt`` is overwritten as training goes on: results of an older version are stale."""
    calls = []
    handle = alibi_model.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        subj = Subject("alibi", alibi_model, "lm", eval_stream, checkpoint="run/last.ckpt", fingerprint="v1")
        run([subj], settings(lengths=[16], modes=("nonoverlap",)), tmp_path, plots=False)
        n = len(calls)
        run([subj], settings(lengths=[16], modes=("nonoverlap",)), tmp_path, plots=False)
        assert len(calls) == n  # same file: skipped
        subj.fingerprint = "v2"
        res = run([subj], settings(lengths=[16], modes=("nonoverlap",)), tmp_path, plots=False)
        assert len(calls) > n and res.meta["stale_rows_dropped"] == 1
        assert [r["fingerprint"] for r in res.rows] == ["v2"]
    finally:
        handle.remove()


def test_eval_rules_that_combine_fields_are_one_report(read_extrapolate):
    """No checkpoints and an unknown mode: both lines in one error, before any checkpoint is looked for."""
    with pytest.raises(ConfigError) as info:
        read_extrapolate(checkpoints=[], modes=["both"])
    text = str(info.value)
    assert text.startswith("2 configuration problems:"), text
    assert "eval=extrapolate needs checkpoints" in text and "eval.modes=['both'] is invalid" in text
    with pytest.raises(ConfigError) as info:
        read_extrapolate(modes=["streaming"], stride=0)
    assert "eval.stride=0" in str(info.value) and "includes streaming, but eval.streaming is not set" in str(
        info.value
    )


def test_translate_rules_are_one_report():
    """eval=translate: no checkpoint or run, and up_to_step without average_last, in one error."""
    from hydra import compose, initialize_config_module

    from posformer.eval.settings import read_eval

    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("eval", overrides=["eval=translate", "eval.up_to_step=100", "paths.output_dir=out"])
    with pytest.raises(ConfigError) as info:
        read_eval(cfg, "translate")
    text = str(info.value)
    assert text.startswith("2 configuration problems:"), text
    assert "eval=translate needs eval.checkpoint=<.ckpt> or eval.run_dir" in text
    assert "eval.up_to_step selects the checkpoints to average" in text

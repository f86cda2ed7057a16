"""``posformer-eval eval.context_parallel=P``: every LM window split across P processes.

The slow case evaluates a tiny trained language model at a few lengths in 2 CPU processes (gloo) and in
one, and gets the same perplexities (within 1e-5 relative), scored tokens and per-position curves; the
token count leaves a shorter last ``nonoverlap`` window (scored whole by rank 0). The fast cases: each
refusal is one line, before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posformer.errors import ConfigError
from posformer.eval.parallel import check_eval_split, combine, split_window
from posformer.model import ModelConfig
from posformer.model.parallel import ContextParallel

#: the tolerance of the issue: split equals unsplit in float32
TOL = 1e-5


def lm_run_dir(tmp_path: Path, steps: int = 30) -> Path:
    """A run dir (``checkpoints/last.ckpt`` + ``config.yaml``) of a tiny rope language model trained for
    ``steps`` steps on a small text (2 heads, block size 16)."""
    from omegaconf import OmegaConf

    from posformer.data import build_datamodule
    from posformer.lit import LanguageModelModule

    text = tmp_path / "t.txt"
    text.write_text(
        "".join(f"line {i % 13}: to be or not to be, that is the question.\n" for i in range(120))
    )
    data_cfg = {
        "name": "text",
        "path": str(text),
        "block_size": 16,
        "cache_dir": str(tmp_path / "cache"),
        "val_fraction": 0.25,
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
        n_layers=2,
        d_ff=64,
        dropout=0.0,
        pe="rope",
    ).to_dict()
    module = LanguageModelModule(model=fields, data={"task_type": "lm", "train_length": 16})
    opt = torch.optim.Adam(module.parameters(), lr=3e-3)
    batches = iter(dm.train_dataloader())
    for _ in range(steps):
        batch = next(batches, None) or next(batches := iter(dm.train_dataloader()))
        logits = module.model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(
        {"hyper_parameters": dict(module.hparams), "state_dict": module.eval().state_dict()},
        run_dir / "checkpoints" / "last.ckpt",
    )
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml({"seed": 0, "data": data_cfg}))
    return run_dir


def evaluate(run_dir: Path, out: Path, read_extrapolate, **values) -> list[dict]:
    """``posformer-eval`` of ``run_dir``'s checkpoint with ``values`` set in ``eval``; its result rows."""
    from posformer.eval.run import run_extrapolation

    s = read_extrapolate(
        checkpoints=[str(run_dir / "checkpoints" / "last.ckpt")],
        output_dir=str(out),
        progress=False,
        tensorboard=False,
        **values,
    )
    return run_extrapolation(s).rows


@pytest.mark.slow  # two evaluations, one of them in two spawned processes
def test_split_evaluation_equals_one_process(tmp_path: Path, read_extrapolate) -> None:
    run_dir = lm_run_dir(tmp_path)
    values = dict(
        lengths=[16, 32, 64], n_tokens=200, modes=["nonoverlap", "sliding"]
    )  # 200 % 64: a short tail
    one = {
        (r["mode"], r["length"]): r for r in evaluate(run_dir, tmp_path / "p1", read_extrapolate, **values)
    }
    two = evaluate(run_dir, tmp_path / "p2", read_extrapolate, context_parallel=2, **values)
    assert len(two) == len(one) == 6
    for row in two:
        ref = one[(row["mode"], row["length"])]
        assert row["status"] == ref["status"] == "ok"
        assert row["scored_tokens"] == ref["scored_tokens"] == 200
        assert row["ppl"] == pytest.approx(ref["ppl"], rel=TOL)
        if "position_loss" in ref:
            assert row["position_loss"] == pytest.approx(ref["position_loss"], rel=TOL, abs=1e-4)
    saved = json.loads((tmp_path / "p2" / "extrapolation.json").read_text())  # rank 0's files
    assert saved["meta"]["finished"] and saved["meta"]["config"]["context_parallel"] == 2
    assert len(saved["results"]) == 6


def test_refusals_are_one_line_before_any_process(tmp_path: Path, read_extrapolate, monkeypatch) -> None:
    from posformer.eval import parallel

    def no_spawn(*args, **kwargs):
        raise AssertionError("a refused split must not start processes")

    monkeypatch.setattr(parallel, "spawn", no_spawn)
    monkeypatch.setattr("posformer.eval.run.spawn", no_spawn)
    lm = {"model": {"kind": "decoder", "n_heads": 2}, "data": {"task_type": "lm"}}
    cases = [
        (dict(lengths=[16, 33], checkpoints={"a.ckpt": lm}), "33"),
        (
            dict(lengths=[16], checkpoints={"a.ckpt": {"model": {"kind": "decoder", "n_heads": 3}}}),
            "n_heads=3",
        ),
        (
            dict(lengths=[16], checkpoints={"a.ckpt": {"model": {"kind": "encoder_decoder"}}}),
            "encoder_decoder",
        ),
        (dict(lengths=[16], checkpoints={"a.ckpt": {"data": {"task_type": "task"}}}), "'task'"),
        (dict(lengths=[16], checkpoints={"a.ckpt": lm}, modes=["streaming"]), "streaming"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ConfigError, match=needle) as exc:
            check_eval_split(2, accelerator="cpu", **kwargs)
        assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="one per device") as exc:
        check_eval_split(10_000, accelerator="cpu", lengths=[], checkpoints={})
    check_eval_split(2, accelerator="cpu", lengths=[16, 32], checkpoints={"a.ckpt": lm})  # fine
    with pytest.raises(ConfigError, match="context_parallel"):
        read_extrapolate(context_parallel=0)

    # the command's own path: a length not divisible by P is refused from the saved checkpoint alone
    run_dir = lm_run_dir(tmp_path, steps=0)
    with pytest.raises(ConfigError, match="eval.lengths has 15") as exc:
        evaluate(run_dir, tmp_path / "out", read_extrapolate, context_parallel=2, lengths=[16, 15])
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out" / "extrapolation.json").exists()


def test_one_process_pieces_are_the_identity() -> None:
    """Without a group (or P=1) a window is whole and the sums are as they are."""
    x = torch.arange(12).view(2, 6)
    assert split_window(None, x) == (False, 0, 6, (x,))
    split, s, e, (part,) = split_window(ContextParallel(), x)
    assert (split, s, e) == (False, 0, 6) and part is x
    sums = (torch.tensor(1.5, dtype=torch.float64),)
    assert combine(ContextParallel(), *sums) == sums

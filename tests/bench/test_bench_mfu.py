"""Model FLOPs utilisation (``posformer-bench --sections mfu``) and the fused optimiser.

The FLOPs are counted analytically and checked here against an independent count of the model's
weight matrices; the section runs on the CPU (fp32, tiny) exactly as on CUDA, where its reference
matmul is bf16. Training uses the fused AdamW kernel on CUDA and the default one on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from posformer.bench.config import BASELINE_PE, BenchConfig, apply_quick, matmul_reference_dtype
from posformer.bench.models import flops_per_token, posformer_model
from posformer.bench.run import run
from posformer.cli.bench import parse_args
from posformer.lit.optim import build_optimizer, fused_supported

CUDA = torch.cuda.is_available()
OPTIM = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}
SCHEDULE = {"name": "constant"}


@pytest.mark.parametrize("pe", [BASELINE_PE, "rope", "alibi", "t5"])
def test_flops_are_counted_analytically(pe: str) -> None:
    """6 x the weight matrices, in closed form for this decoder (tied embedding V·d once; per layer qkv
    3d², output d², FFN 2·4d²: 12·d²; no position table, no bias or norm), plus 12·L·d·T."""
    vocab, layers, d, t = 64, 3, 32, 48
    model = posformer_model(pe, BenchConfig(vocab=vocab, n_layers=layers, n_heads=2), d, t)
    flops = flops_per_token(model, layers, d, t)
    assert flops["matmul"] == 6 * (vocab * d + 12 * layers * d * d)
    assert flops["attention"] == 12 * layers * d * t
    assert flops["total"] == flops["matmul"] + flops["attention"]


def test_the_reference_matmul_is_bf16_on_cuda_and_the_models_dtype_on_the_cpu() -> None:
    assert matmul_reference_dtype(torch.device("cuda"), torch.float32) == torch.bfloat16
    assert matmul_reference_dtype(torch.device("cpu"), torch.float32) == torch.float32


def test_mfu_section_on_the_cpu(tmp_path: Path) -> None:
    """Every (PE, width) measured, its FLOP/s = tok/s x the analytic FLOPs, its MFU = that over the
    same-run matmul, every repetition kept; both tables name the PEs."""
    cfg = parse_args(
        ["--quick", "--device", "cpu", "--sections", "mfu", "--mfu-pes", "nope,alibi", "--no-compare"]
    )
    cfg.out, cfg.reps = str(tmp_path), 2
    run(cfg, log=lambda _: None)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data["mfu"]) == {"32", "alibi/32"}
    for key, rec in data["mfu"].items():
        assert rec["pe"] == ("alibi" if key.startswith("alibi") else BASELINE_PE) and rec["d_model"] == 32
        assert len(rec["reps"]["tok_s"]) == len(rec["reps"]["matmul_flops"]) == 2
        assert rec["matmul_dtype"] == "float32"
        expect = rec["tok_s"] * rec["flops_per_token"]["total"] / 1e9
        assert rec["model_gflops"] == pytest.approx(expect)
        assert rec["mfu"] == pytest.approx(rec["model_gflops"] / rec["matmul_gflops"])
        assert 0 < rec["attention_share"] < 1
    mfu_table = (tmp_path / "bench.md").read_text().split("| PE | d_model |")[-1]
    assert f"| {BASELINE_PE} " in mfu_table and "| alibi " in mfu_table


def test_unknown_mfu_pe_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--mfu-pes", "nope,bogus"])
    assert info.value.code == 2
    assert "--mfu-pes: unknown PE(s) ['bogus']" in capsys.readouterr().err


def test_quick_keeps_the_mfu_pes() -> None:
    cfg = parse_args(["--mfu-pes", "rope,t5"])
    apply_quick(cfg)
    assert cfg.mfu_pes == ["rope", "t5"] and cfg.mfu_d_models == [32]


# ---------------------------------------------------------------------- the optimiser
def test_cpu_training_keeps_the_default_optimizer(tiny_model) -> None:
    """CPU: not fused (the same updates as before, bitwise); meta or mixed devices: not fused either."""
    model = tiny_model("alibi")
    opt = build_optimizer(model, OPTIM, SCHEDULE)
    assert not opt.defaults.get("fused")
    assert not fused_supported(list(model.parameters()))
    assert not fused_supported([torch.zeros(2, device="meta")]) and not fused_supported([])


def test_optim_fused_chooses_the_kernel_on_any_device(tiny_model) -> None:
    """``optim.fused``: true takes torch's fused kernel on the CPU too, false never, null where
    ``fused_supported`` says (CUDA), the default (a value that is not a bool: test_bad_input)."""
    model = tiny_model("alibi")
    for fused, expected in ((True, True), (False, False), (None, False)):
        opt = build_optimizer(model, {**OPTIM, "fused": fused}, SCHEDULE)
        assert bool(opt.defaults.get("fused")) is expected
    with initialize_config_module("posformer.configs", version_base="1.3"):
        assert compose("train").optim.fused is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_training_uses_the_fused_optimizer(tiny_model) -> None:
    model = tiny_model("alibi").cuda()
    opt = build_optimizer(model, OPTIM, SCHEDULE)
    assert opt.defaults.get("fused") is True
    loss = model(torch.randint(1, 13, (2, 8), device="cuda")).float().square().mean()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))

"""A training step on CUDA's attention paths, rehearsed on the CPU, eager and compiled.

On CUDA the decision sends every bias PE to FlexAttention (through ``torch.compile(flex_attention,
dynamic=True)``), packed rows too, and Shaw's and CoPE's shortcuts run their far keys in Flex with its
differentiable log-sum-exp. A compiled model (``compile.enabled=true``, ``Module.compile``) traces Flex
inside its own graph, with the learned biases' captured tensors built there, and calls the compiled
kernel in the regions a graph break leaves eager. None of that runs on the CPU, where the decision
picks SDPA's paths. Here each model takes CUDA's decisions with CPU tensors
(:func:`flex_lowering.as_on_cuda`): Flex is traced by AOT autograd and run with the eager kernels,
inductor's joint-graph check is run on each Flex backward, and one training step is compared with the
eager model on the CPU's own paths: the logits and every parameter gradient, fp32 to 1e-5.
The same step under bf16 and fp16 autocast (CUDA's default precision, and the one of GPUs without
bf16) is held to the CPU paths' own half-precision error. What is left to the GPU is inductor's code
generation (``scripts/gpu_check.sh``; stage mc of ``scripts/gpu_speed.sh`` for the compiled model). The
whole grid, every PE x rows x eager/compiled (x bf16/fp16):
``POSFORMER_FULL_GRID=1 pytest tests/model/test_compiled_on_cuda_paths.py -n 2``.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from posformer.eval.decoding import beam_search, generate
from posformer.model.backends import flex
from posformer.pe import ENCODINGS, list_encodings
from tests.cli_cases import TINY_DATA
from tests.flex_lowering import as_on_cuda, checked_backend, record_choices, record_lse_calls

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")
ROWS = ("plain", "left-padded", "packed", "translation-padded")
#: the cases the slow pass runs by default, with the path CUDA takes for them: a learned bias's offset vector
#: (captured, built inside the compiled graph) and Shaw's shortcut on packed rows (Flex with block
#: masks and its log-sum-exp); with POSFORMER_FULL_GRID=1 (``slow``) every PE x rows x mode
QUICK = {("t5", "plain", "compiled"): "flex", ("shaw", "packed", "compiled"): "shortcut"}


#: with POSFORMER_FULL_GRID=1 every PE x rows x mode (112 cases, ~8 min on 2 cores) and every PE's
#: decoding; else the cases above (the suites' time budgets)
FULL = bool(os.environ.get("POSFORMER_FULL_GRID"))


def _cases() -> list[Any]:
    grid = [(pe, rows, mode) for mode in ("eager", "compiled") for pe in list_encodings() for rows in ROWS]
    return [
        pytest.param(*case, id="-".join(case), marks=() if case in QUICK else pytest.mark.slow)
        for case in grid
        if FULL or case in QUICK
    ]


def _model_and_batch(pe: str, rows: str, tiny_model: Any, decoder_batch: Any) -> tuple[Any, tuple]:
    """A 2-layer model with heads of 16 (the least Flex's GPU kernel takes) and its batch of ``rows``."""
    anywhere = "shortcut_min_len" in inspect.signature(ENCODINGS[pe]).parameters  # Shaw's at 40 tokens too
    options = {"shortcut_min_len": 0} if anywhere else {}
    sizes = {"d_model": 32, "n_heads": 2, "n_layers": 2, "pe_options": options}
    if rows != "translation-padded":
        return tiny_model(pe, **sizes).train(), decoder_batch(rows)
    model = tiny_model(pe, "encoder_decoder", **sizes, n_encoder_layers=2, n_decoder_layers=2).train()
    src, tgt = (torch.randint(0, 13, (2, n), generator=torch.Generator().manual_seed(n)) for n in (30, 20))
    src_mask = torch.arange(30) < torch.tensor([[30], [23]])  # (B, S): row 1 padded
    tgt_mask = torch.arange(20) < torch.tensor([[20], [14]])  # (B, T)
    return model, (src, tgt, src_mask, tgt_mask)


def _step(model: torch.nn.Module, args: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of a loss over the real target tokens (as training's loss, which never
    reads a padded position): their logits (N, V) and every parameter gradient, by name. A padded
    query's output is not defined by the model and differs between paths (CoPE's masked bias counts the
    gates of padding keys a right-padded query sees past; its training function does not)."""
    model.zero_grad()
    logits = model(*args)  # (B, T, V)
    real = args[3] if len(args) == 4 else args[2] if len(args) == 3 else None  # (B, T) target mask
    logits = logits[real] if real is not None else logits.flatten(0, 1)  # (N, V)
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.slow  # torch.compile on the CPU: 10-35 s a case
@pytest.mark.parametrize(("pe", "rows", "mode"), _cases())
def test_a_step_on_cudas_paths_equals_the_eager_cpu_step(
    pe: str, rows: str, mode: str, tiny_model: Any, decoder_batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch._dynamo.reset()
    model, args = _model_and_batch(pe, rows, tiny_model, decoder_batch)
    ref_logits, ref_grads = _step(model, args)
    kernel_checked = as_on_cuda(monkeypatch)
    used = record_choices(monkeypatch)  # CUDA's decisions (as_on_cuda), each recorded
    lse_calls = record_lse_calls(monkeypatch)  # a shortcut's calls of CUDA's causal kernel (Flex)
    backend, model_checked = checked_backend()
    try:
        if mode == "compiled":
            model.compile(backend=backend, dynamic=None)  # what compile.enabled=true does, its defaults
        logits, grads = _step(model, args)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=f"d{name}")
    assert used and QUICK.get((pe, rows, mode), used[0]) in used  # CUDA's decisions were taken
    if "flex" in used or lse_calls:  # CUDA's Flex ran: its backward traced, inductor's check passed
        assert kernel_checked or model_checked, used


# ------------------------------------------------------------------------------------ half precision
#: CUDA trains under bf16 autocast by default (``bf16-mixed``; ``16-mixed`` where the GPU has no bf16);
#: the cases above are float32. By default one case: a learned offset bias's compiled step in bf16
HALF_QUICK = {("t5", "plain", "compiled", "bf16")}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _half_cases() -> list[Any]:
    grid = [
        (pe, rows, mode, dtype)
        for dtype in HALF
        for mode in ("eager", "compiled")
        for pe in list_encodings()
        for rows in ROWS
    ]
    return [
        pytest.param(*case, id="-".join(case), marks=() if case in HALF_QUICK else pytest.mark.slow)
        for case in grid
        if FULL or case in HALF_QUICK
    ]


def _errors(step: tuple[torch.Tensor, dict], ref: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """A step's largest logit error and largest gradient error (relative to the largest gradient of any
    parameter) against the float32 step ``ref``."""
    scale = max(g.abs().max().item() for g in ref[1].values())
    logits = (step[0].float() - ref[0]).abs().max().item()
    grads = max((step[1][n].float() - g).abs().max().item() for n, g in ref[1].items()) / scale
    return logits, grads


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize(("pe", "rows", "mode", "dtype"), _half_cases())
def test_a_half_precision_step_on_cudas_paths_is_as_accurate_as_the_cpus(
    pe: str,
    rows: str,
    mode: str,
    dtype: str,
    tiny_model: Any,
    decoder_batch: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under bf16 or fp16 autocast, one step on CUDA's paths (Flex with float32 captured biases, the
    shortcuts, the key columns), eager or compiled, runs and is as close to the model's float32 step as
    the same autocast step on the CPU's own paths: its logit and gradient errors within 3x the CPU's
    (both round the same matmuls outside attention; inside it the kernels differ in order only: 1.9x
    at most over every PE x rows x dtype, eager). A path that dropped a bias term or rounded the bias
    to the half type before a long sum would be off by far more."""
    torch._dynamo.reset()
    model, args = _model_and_batch(pe, rows, tiny_model, decoder_batch)
    ref = _step(model, args)
    with torch.autocast("cpu", dtype=HALF[dtype]):
        cpu = _errors(_step(model, args), ref)
    as_on_cuda(monkeypatch)
    used = record_choices(monkeypatch)  # CUDA's decisions (as_on_cuda), each recorded
    backend, _ = checked_backend()
    try:
        if mode == "compiled":
            model.compile(backend=backend, dynamic=None)
        with torch.autocast("cpu", dtype=HALF[dtype]):
            cuda = _errors(_step(model, args), ref)
    finally:
        torch._dynamo.reset()
    assert used
    assert cuda[0] <= 3 * cpu[0] and cuda[1] <= 3 * cpu[1], (cuda, cpu, sorted(set(used)))


# ------------------------------------------------------------------------------------ decoding
def _decoding_cases() -> list[Any]:
    quick = {"t5", "cope"}  # a learned offset vector at the prefill, CoPE's saturation shortcut
    return [
        pytest.param(pe, marks=() if pe in quick else pytest.mark.slow)
        for pe in list_encodings()
        if FULL or pe in quick
    ]


@pytest.mark.parametrize("pe", _decoding_cases())
def test_decoding_on_cudas_paths_equals_the_cpu_paths(
    pe: str, tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cached generation (a Flex prefill over the prompt, then one-query steps) and cached beam search of
    a translation model (padded sources, bidirectional encoder) on CUDA's paths give the CPU paths'
    tokens, and the beam scores to 1e-5."""
    sizes = {"d_model": 32, "n_heads": 2, "n_layers": 2, "n_encoder_layers": 2, "n_decoder_layers": 2}
    decoder = tiny_model(pe, **sizes)
    seq2seq = tiny_model(pe, "encoder_decoder", **sizes)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 13, (2, 300), generator=gen)  # past Shaw's and CoPE's least lengths
    src = torch.randint(3, 13, (3, 40), generator=gen)
    src_mask = torch.arange(40) < torch.tensor([[40], [31], [12]])  # (B, S)

    def decode() -> tuple[torch.Tensor, list]:
        with torch.no_grad():
            tokens = generate(decoder, prompt, 6, use_cache=True)
            beams = beam_search(seq2seq, src, src_mask, beam_size=3, max_len_b=6, return_scores=True)
        return tokens, beams

    ref_tokens, ref_beams = decode()
    as_on_cuda(monkeypatch)
    used = record_choices(monkeypatch)  # CUDA's decisions (as_on_cuda), each recorded
    try:
        tokens, beams = decode()
    finally:
        torch._dynamo.reset()
    assert torch.equal(tokens, ref_tokens)
    assert [b[0] for b in beams] == [b[0] for b in ref_beams]
    assert [b[1] for b in beams] == pytest.approx([b[1] for b in ref_beams], abs=1e-5)
    if pe in ("t5", "fire", "cope", "shaw"):
        assert {"flex", "shortcut"} & set(used), used  # the prefill took CUDA's path


# ------------------------------------------------------------------------------------ whole flows
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [
            "pe=t5",
            "data=corpus",
            "data.n_chars=20000",
            "data.block_size=32",
            "data.batch_size=4",
            "data.pack=true",
            "data.eval_lengths=[32,64]",
            "data.eval_tokens=256",
            "model.n_layers=2",
        ],
        [
            "pe=shaw",
            "model=encdec_tiny",
            "model.pe_options.shortcut_min_len=0",
            "model.pe_options.max_relative_position=2",
            *TINY_DATA,
        ],  # far keys (Flex) in short rows
        pytest.param(
            [
                "pe=forget_alibi",
                "compile.enabled=true",
                "compile.backend=aot_eager",
                "model.n_layers=2",
                *TINY_DATA,
            ],
            marks=() if FULL else pytest.mark.skip(reason="23 s: with POSFORMER_FULL_GRID=1"),
        ),
    ],
    ids=["t5-packed-corpus", "shaw-translation", "forget_alibi-compiled"],
)
def test_posformer_train_on_cudas_paths(
    args: list[str], tmp_path: Any, cache_dir: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``posformer-train`` end to end (training steps, validation, the final evaluation at longer
    lengths, results) with every attention call on CUDA's path: Flex and the shortcuts through the
    traced kernel, inductor's joint-graph check on each Flex backward."""
    from tests.cli_cases import QUIET, TINY_TRAINING, train_cli

    checked = as_on_cuda(monkeypatch)
    used = record_choices(monkeypatch)  # CUDA's decisions (as_on_cuda), each recorded
    tiny = [*TINY_TRAINING, *QUIET, "callbacks.model_checkpoint.monitor=null", "model.d_ff=64"]
    heads_of_16 = ["model.d_model=32", "model.n_heads=2"]  # the least head size Flex's GPU kernel takes
    try:
        code, text = train_cli([*heads_of_16, *args], tmp_path / "run", cache_dir, monkeypatch, capsys, tiny)
    finally:
        torch._dynamo.reset()
    assert code == 0, text[-3000:]
    assert (tmp_path / "run" / "results.json").is_file()
    assert {"flex", "shortcut"} & set(used), sorted(set(used))
    # Flex's backward traced by the kernel and checked (a compiled model traces it in its own graph)
    assert checked or "compile.enabled=true" in args


# ------------------------------------------------------------------------------------ the cuda tests
@pytest.mark.slow
def test_every_cuda_test_body_runs_on_the_cpu_on_cudas_paths() -> None:
    """``scripts/rehearse_cuda_tests.py``: the body of every ``cuda`` test that takes no CLI fixtures
    passes here on CUDA's paths, so none fails a GPU window for a reason a CPU could have shown (four
    did in one GPU window: mismatched head sizes, heads of 8, a length below Shaw's shortcut threshold)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "rehearse_cuda_tests.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"runs: [1-9]\d* OK, 0 FAIL", done.stdout), done.stdout[-2000:]

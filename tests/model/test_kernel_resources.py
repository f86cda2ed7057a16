"""A compiled kernel that needs more GPU shared memory than the device has, and the way around it.

FlexAttention's Triton kernels (and ``compile.enabled=true``'s) pick block sizes by the GPU's compute
capability; on GPUs with less shared memory per block than an A100/H100 (an RTX 3090/4090 or A10's
~100 KB, a T4's 64 KB) a configuration can need more than there is, and Triton raises
``OutOfResources: out of resource: shared memory, Required: …, Hardware limit: …`` (inductor wraps it;
compare pytorch/pytorch#133254). The lent GPUs (H100, H200) never show it, so the CPU tests raise
the same exception chain. Each main reports it in one line naming the fix: the SDPA attention
backend, which ``posformer-eval`` can now choose for any checkpoint (``eval.attention_backend``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from posformer.cli.boundary import error_line
from tests.cli_cases import assert_clean_failure, eval_cli, train_cli


class OutOfResources(Exception):
    """Triton's exception (``triton.runtime.errors.OutOfResources``), by name and message."""


def _kernel_error() -> RuntimeError:
    """What inductor raises around Triton's error (its message words the inner one "OutOfMemoryError")."""
    inner = OutOfResources("out of resource: shared memory, Required: 139776, Hardware limit: 101376.")
    try:
        raise inner
    except OutOfResources as exc:
        outer = RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_0")
        outer.__cause__ = exc
        return outer


@pytest.mark.parametrize(
    "prog, fix",
    [
        ("", "model.attention_backend=sdpa"),
        ("posformer-eval", "eval.attention_backend=sdpa"),
        ("posformer-bench", "--attention-backend sdpa"),
    ],
)
def test_the_line_names_the_kernel_and_the_fix_not_memory(prog: str, fix: str) -> None:
    line = error_line(_kernel_error(), prog)
    assert (
        line is not None and "needs more shared memory or registers than this GPU has" in line and fix in line
    )
    assert "No valid triton configs" in line and "lower data.batch_size" not in line
    wrapped = RuntimeError("compiling failed")
    wrapped.__context__ = OutOfResources("out of resource: shared memory")  # found behind the context too
    assert "shared memory" in (error_line(wrapped, prog) or "")
    launch = RuntimeError("CUDA error: too many resources requested for launch")  # registers
    assert fix in (error_line(launch, prog) or "")
    assert error_line(RuntimeError("a bug"), prog) is None  # anything else stays a traceback


class RaiseKernelError(Callback):
    """Test-only: the first training batch raises the kernel error."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        raise _kernel_error()


def test_training_reports_the_kernel_error_in_one_line(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["+callbacks.kernel._target_=tests.model.test_kernel_resources.RaiseKernelError"]
    code, text = train_cli(args, tmp_path / "run", cache_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, "needs more shared memory or registers than this GPU has", "model.attention_backend=sdpa"
    )


def test_eval_chooses_the_attention_backend_of_every_checkpoint(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``eval.attention_backend=sdpa`` reaches every attention call (the backend decision's policy);
    the checkpoint's own (``auto``) without it; a value outside auto/flex/sdpa is one line."""
    import posformer.model.attention as attention

    seen: list[str] = []
    choose = attention.choose
    monkeypatch.setattr(
        attention,
        "choose",
        lambda q, k, ctx, **kw: (seen.append(ctx.policy.choice), choose(q, k, ctx, **kw))[1],
    )
    ckpt = trained / "checkpoints" / "last.ckpt"
    base = [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]", "trainer=cpu"]
    code, text = eval_cli([*base, "eval.attention_backend=sdpa"], tmp_path / "sdpa", monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert seen and set(seen) == {"sdpa"}
    seen.clear()
    code, text = eval_cli(base, tmp_path / "auto", monkeypatch, capsys)
    assert code == 0 and seen and set(seen) == {"auto"}, text[-3000:]
    code, text = eval_cli([*base, "eval.attention_backend=triton"], tmp_path / "bad", monkeypatch, capsys)
    assert_clean_failure(code, text, "eval.attention_backend='triton'", "sdpa")


def test_the_eval_choices_are_the_models() -> None:
    from posformer.configs.eval_schema import ATTENTION_BACKEND
    from posformer.model.policy import ATTENTION_BACKENDS

    assert ATTENTION_BACKEND.choices == ATTENTION_BACKENDS

"""Process-wide CPU settings (:mod:`posformer.cpu`): denormal flushing, as the entry points apply it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posformer.cpu import configure_cpu
from posformer.errors import ConfigError
from tests.cli_cases import TINY_RUN, train_cli

#: a float32 product in the denormal range (about 1e-39): 0 when denormals are flushed
TINY, FACTOR = 1e-30, 1e-9


def _denormal_product() -> float:
    return float(torch.tensor([TINY]) * torch.tensor([FACTOR]))


def test_configure_cpu_flushes_and_keeps_denormals():
    configure_cpu(flush_denormal=False)
    assert 0 < _denormal_product() < 1.2e-38
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    configure_cpu(flush_denormal=True)
    assert _denormal_product() == 0.0


def test_flushing_leaves_biased_attention_unchanged():
    """ALiBi-like scores hundreds below the row maximum make denormal probabilities; flushing them
    changes the attention output by less than 1e-30 (here: not at all, it is below fp32's ulp)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    i = torch.arange(256)
    mask = -(i[:, None] - i[None, :]).abs().float() * 0.9  # (256, 256): up to -230 below the diagonal
    mask = mask.masked_fill(i[None, :] > i[:, None], float("-inf"))
    outs = []
    for flush in (False, True):
        configure_cpu(flush_denormal=flush)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert (outs[0] - outs[1]).abs().max() < 1e-30


def test_configure_cpu_rejects_a_non_boolean():
    with pytest.raises(ConfigError, match="flush_denormal='yes' must be true or false"):
        configure_cpu(flush_denormal="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("flush", [True, False])
def test_training_applies_the_setting(flush, tmp_path, monkeypatch, capsys):
    """``posformer-train flush_denormal=...`` sets the process before training (default: flush)."""
    configure_cpu(flush_denormal=not flush)
    args = ["trainer.max_steps=1", "evaluate=false"] + ([] if flush else ["flush_denormal=false"])
    code, text = train_cli(args, tmp_path / "run", tmp_path / "cache", monkeypatch, capsys, tiny=TINY_RUN)
    assert code == 0, text
    assert (_denormal_product() == 0.0) == flush

"""MFU beside tokens/s: the devices' peak (POSFORMER_PEAK_FLOPS, a known GPU's, else none: "n/a"), the
FLOPs per token of a run's model (the benchmark's count), and the LM curves and headline a logger gets."""

from __future__ import annotations

import pytest

from posformer.devices import PEAK_FLOPS_ENV, peak_flops
from posformer.errors import ConfigError
from posformer.lit.callbacks import run_flops_per_token
from posformer.lit.loggers import curve_metrics, headline
from posformer.lit.modules import module_class
from posformer.model.flops import flops_per_token


def test_the_peak_is_the_environment_value_or_none_on_the_cpu(monkeypatch):
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert peak_flops("cpu", "32-true") is None  # the line says "MFU n/a"
    monkeypatch.setenv(PEAK_FLOPS_ENV, "2.5e11")
    assert peak_flops("cpu", "32-true") == 2.5e11
    for bad in ("fast", "-1", "nan"):
        monkeypatch.setenv(PEAK_FLOPS_ENV, bad)
        with pytest.raises(ConfigError, match=f"{PEAK_FLOPS_ENV}='{bad}' is not a positive number") as err:
            peak_flops("cpu", "32-true")
        assert "e.g. POSFORMER_PEAK_FLOPS=989e12" in str(err.value)


def test_a_run_counts_6n_plus_the_attention_term():
    model = {"kind": "decoder", "d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "pe": "rope"}
    module = module_class("decoder")(
        model={**model, "vocab_size": 11, "pad_id": 0}, data={"train_length": 32}
    )
    counted = flops_per_token(module.model, 2, 16, 32)
    assert run_flops_per_token(module) == counted["total"]
    assert counted["attention"] == 12 * 2 * 16 * 32 and counted["matmul"] > 6 * 2 * 4 * 16 * 16


def test_a_language_model_logs_perplexity_curves_and_no_task_metric():
    assert curve_metrics("lm") == ["loss", "ppl"] and curve_metrics("task") == ["exact_match", "token_acc"]
    rows = [
        {"length": 32, "in_distribution": True, "n_sequences": 4, "ppl": 2.0, "exact_match": 0.0},
        {"length": 64, "in_distribution": False, "n_sequences": 2, "ppl": 4.0, "exact_match": 0.0},
    ]
    assert headline(rows, "ppl") == {"hp/ppl_train_len": 2.0, "hp/ppl_longest": 4.0, "hp/ppl_ood_mean": 4.0}
    assert set(headline(rows)) == {
        "hp/exact_match_train_len",
        "hp/exact_match_longest",
        "hp/exact_match_ood_mean",
    }

"""Hugging Face models in and out (:mod:`posformer.interop`): a tiny random GPT-NeoX folder the test saves
(no hub) imports with its ``rope_parameters`` and tokenizer; a trained run and every PE HF can express
export to a folder ``AutoModelForCausalLM`` loads; logits agree within 1e-5 both ways; the rest is
refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posformer.checkpoints.read import read_checkpoint
from posformer.errors import ConfigError
from posformer.interop import export_hf, hf_to_checkpoint, import_hf
from posformer.model import ModelConfig, build_model
from posformer.runs import load_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = 1e-5
VOCAB = 40
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer of VOCAB words, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def _hf_neox(folder: Path, rope: dict, *, tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        use_parallel_residual=False,
        tie_word_embeddings=tie,
        max_position_embeddings=64,
        rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5, **rope},
    )
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the init's zeros and ones: every tensor matters
    model.save_pretrained(folder)
    return model


def _max_diff(ours: torch.nn.Module, hf: torch.nn.Module, length: int) -> float:
    ids = torch.randint(0, ours.cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, YARN], ids=["rope", "yarn"])
def test_an_hf_neox_folder_imports_with_its_logits(tmp_path: Path, rope: dict) -> None:
    hf = _hf_neox(tmp_path, rope)
    _tokenizer(tmp_path)
    cfg, state, tok = import_hf(tmp_path)
    assert cfg.pe == "rope" and cfg.pe_options["base"] == 500.0 and cfg.pe_options["rotary_fraction"] == 0.5
    if rope is YARN:
        assert cfg.pe_options["scaling"] == {"type": "yarn", "factor": 4.0, "original_max_len": 16}
    ours = build_model(cfg).eval()
    ours.load_state_dict(state)
    for length in (8, 48):  # inside and past YaRN's original length
        assert _max_diff(ours, hf, length) < TOL
    assert tok("w3 w7")["input_ids"] == [3, 7]


def test_an_imported_folder_becomes_an_init_from_checkpoint_with_a_scaling(tmp_path: Path) -> None:
    hf = _hf_neox(tmp_path / "hf", {"rope_type": "default"}, tie=True)
    pi = {"type": "linear", "factor": 2.0}
    path = hf_to_checkpoint(tmp_path / "hf", tmp_path / "imported.ckpt", scaling=pi)
    ckpt = read_checkpoint(path)  # what init_from= reads
    cfg = ModelConfig(**ckpt["hyper_parameters"]["model"])
    assert cfg.pe_options["scaling"] == pi
    ours = build_model(cfg).eval()
    own = ours.state_dict()
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert set(state) == set(own)
    ours.load_state_dict(state)
    ours.layer_pes.place("decoder").set_scaling(None)  # unscaled: the HF model's logits
    assert _max_diff(ours, hf, 24) < TOL


def test_a_trained_run_exports_to_automodel_with_its_logits(tiny_run_dir: Path, tmp_path: Path) -> None:
    run = load_run(tiny_run_dir)
    export_hf(run, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    assert _max_diff(run.model.eval(), hf, 12) < TOL
    cfg, state, _ = import_hf(tmp_path)  # and back
    back = build_model(cfg).eval()
    back.load_state_dict(state)
    assert _max_diff(back, hf, 12) < TOL


CASES = [
    ("rope", {"layout": "interleaved", "rotary_fraction": 0.5}, {"bias": False}),
    ("rope", {"scaling": {"type": "yarn", "factor": 4.0, "original_max_len": 16}}, {"tie_embeddings": True}),
    ("rope", {"scaling": {"type": "linear", "factor": 2.0}}, {"activation": "relu"}),
    ("rope", {"scaling": {"type": "dynamic_ntk", "factor": 2.0, "original_max_len": 16}}, {}),
    (
        "rope",
        {
            "scaling": {
                "type": "longrope",
                "factor": 4.0,
                "original_max_len": 16,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
            }
        },
        {},
    ),
    ("nope", {}, {}),
    ("learned", {}, {}),
    ("sinusoidal", {}, {"bias": False}),
]


@pytest.mark.parametrize(("pe", "options", "extra"), CASES, ids=lambda v: str(v)[:24])
def test_every_pe_hf_expresses_exports_with_its_logits(
    tmp_path: Path, pe: str, options: dict, extra: dict
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, dropout=0.0, pe=pe, pe_options=options, **extra
    )
    ours = build_model(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_hf(ours, tmp_path, n_positions=64 if pe != "learned" else None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for length in (8, 40):
        assert _max_diff(ours, hf, length) < TOL


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"pe": "alibi"}, "pe='alibi'"),
        ({"pe": "t5"}, "pe='t5'"),
        ({"pe": "rope", "norm_first": False}, "post-LN"),
        ({"pe": "rope", "pe_options": {"head_fraction": 0.5}}, "subset of the heads"),
        ({"pe": "rope", "pe_options": {"scaling": {"type": "ntk", "factor": 2.0}}}, "scaling.type='ntk'"),
    ],
)
def test_what_hf_cannot_express_is_refused_in_one_line(tmp_path: Path, settings: dict, named: str) -> None:
    ours = build_model(ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, **settings))
    with pytest.raises(ConfigError) as err:
        export_hf(ours, tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "config.json").exists()


def test_another_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"import_hf\(Qwen3ForCausalLM\).*this architecture") as err:
        import_hf(tmp_path)
    assert "\n" not in str(err.value)

"""Llama in and out (:mod:`posformer.interop.llama`): a tiny random ``LlamaForCausalLM`` the test saves
(no hub), with grouped-query attention and each rope type HF and posformer share, imports with logits
within 1e-5; a posformer ``norm=rmsnorm mlp=swiglu pe=rope`` decoder exports to a folder
``AutoModelForCausalLM`` loads as Llama, with logits within 1e-5; the new block options leave the
default model as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posformer.checkpoints.read import read_checkpoint
from posformer.errors import ConfigError
from posformer.interop import export_hf, hf_to_checkpoint, import_hf
from posformer.model import ModelConfig, build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = 1e-5
VOCAB = 40
ORIGINAL = 16  # the "pretraining" length of the scaled ropes
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.2, 1.5],
        "long_factor": [1.0, 1.5, 2.0, 4.0],
        "original_max_position_embeddings": ORIGINAL,
    },
}


def _perturb(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the init's zeros and ones: every tensor matters


def _hf_llama(folder: Path, rope: dict, *, kv_heads: int = 2, tie: bool = False, bias: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        num_hidden_layers=2,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        attention_bias=bias,
        max_position_embeddings=4 * ORIGINAL if rope.get("rope_type") == "longrope" else 64,
        rope_parameters={"rope_theta": 500.0, **rope},
    )
    model = transformers.LlamaForCausalLM(config).eval()
    _perturb(model)
    model.save_pretrained(folder)
    return model


def _max_diff(ours: torch.nn.Module, hf: torch.nn.Module, length: int) -> float:
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("name", list(ROPES))
def test_an_hf_llama_folder_imports_with_its_logits(tmp_path: Path, name: str) -> None:
    hf = _hf_llama(tmp_path, ROPES[name])
    cfg, state, _ = import_hf(tmp_path)
    assert (cfg.norm, cfg.mlp, cfg.pe, cfg.norm_eps, cfg.bias) == ("rmsnorm", "swiglu", "rope", 1e-6, False)
    assert cfg.pe_options["base"] == 500.0 and "rotary_fraction" not in cfg.pe_options
    if name == "yarn":
        assert cfg.pe_options["scaling"] == {"type": "yarn", "factor": 4.0, "original_max_len": ORIGINAL}
    ours = build_model(cfg).eval()
    ours.load_state_dict(state)
    for length in (8, 48):  # inside and past the original length
        assert _max_diff(ours, hf, length) < TOL


@pytest.mark.parametrize(
    "kv_heads,tie,bias", [(4, True, False), (1, False, True)], ids=["mha-tied", "mqa-bias"]
)
def test_grouped_heads_tied_embeddings_and_biases_import(tmp_path: Path, kv_heads, tie, bias) -> None:
    hf = _hf_llama(tmp_path, ROPES["default"], kv_heads=kv_heads, tie=tie, bias=bias)
    cfg, state, _ = import_hf(tmp_path)
    assert cfg.tie_embeddings is tie and cfg.bias is bias
    ours = build_model(cfg).eval()
    ours.load_state_dict(state)
    assert _max_diff(ours, hf, 24) < TOL


@pytest.mark.parametrize(
    "scaling",
    [None, {"type": "linear", "factor": 2.0}, {"type": "yarn", "factor": 4.0, "original_max_len": ORIGINAL}],
    ids=["plain", "linear", "yarn"],
)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_a_posformer_llama_exports_to_automodel_with_its_logits(tmp_path: Path, scaling, layout) -> None:
    options = {"base": 500.0, "layout": layout, **({"scaling": scaling} if scaling else {})}
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_layers=2,
        d_ff=48,
        norm="rmsnorm",
        norm_eps=1e-6,
        mlp="swiglu",
        bias=False,
        pe="rope",
        pe_options=options,
    )
    ours = build_model(cfg).eval()
    _perturb(ours)
    export_hf(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    for length in (8, 48):
        assert _max_diff(ours, hf, length) < TOL
    back, state, _ = import_hf(tmp_path)  # and back: the same config, the same logits
    again = build_model(back).eval()
    again.load_state_dict(state)
    assert (back.norm, back.mlp, back.pe_options.get("scaling")) == ("rmsnorm", "swiglu", scaling)
    assert _max_diff(again, hf, 24) < TOL


def test_an_imported_llama_becomes_a_checkpoint_with_its_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = _hf_llama(tmp_path / "hf", ROPES["default"])
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(
        tmp_path / "hf"
    )
    yarn = {"type": "yarn", "factor": 4.0, "original_max_len": ORIGINAL}
    path = hf_to_checkpoint(tmp_path / "hf", tmp_path / "out" / "imported.ckpt", scaling=yarn)
    cfg = ModelConfig(**read_checkpoint(path)["hyper_parameters"]["model"])
    assert (cfg.norm, cfg.mlp, cfg.pe_options["scaling"]) == ("rmsnorm", "swiglu", yarn)
    copied = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    assert copied("w3 w7")["input_ids"] == [3, 7]
    ours = build_model(cfg).eval()
    ours.load_state_dict(
        {k.removeprefix("model."): v for k, v in read_checkpoint(path)["state_dict"].items()}
    )
    ours.layer_pes.place("decoder").set_scaling(None)  # unscaled: the HF model's logits
    assert _max_diff(ours, hf, 24) < TOL


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"norm": "rmsnorm"}, "model.norm='rmsnorm' with model.mlp='mlp'"),
        ({"norm": "rmsnorm", "mlp": "swiglu", "pe": "alibi"}, "pe='alibi' with Llama's block"),
        ({"norm": "rmsnorm", "mlp": "swiglu", "pe_options": {"rotary_fraction": 0.5}}, "partial rotary"),
        ({"mlp": "swiglu"}, "model.norm='layernorm' with model.mlp='swiglu'"),
    ],
)
def test_what_llama_cannot_express_is_refused_in_one_line(tmp_path: Path, settings: dict, named: str) -> None:
    ours = build_model(
        ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, **{"pe": "rope", **settings})
    )
    with pytest.raises(ConfigError) as err:
        export_hf(ours, tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "config.json").exists()


def test_a_llama_with_a_sliding_window_is_refused(tmp_path: Path) -> None:
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=64,
        sliding_window=8,
    )
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"sliding_window=8") as err:
        import_hf(tmp_path)
    assert "\n" not in str(err.value)


def test_the_block_options_change_only_what_they_name(tiny_config) -> None:
    """Defaults build LayerNorm + fc1/fc2 (the models every earlier run saved); rmsnorm and swiglu swap
    just those modules, and a bad value is one line."""
    default = build_model(tiny_config("rope"))
    assert isinstance(default.blocks[0].norm1, torch.nn.LayerNorm) and hasattr(default.blocks[0].ffn, "fc1")
    llama = build_model(tiny_config("rope", norm="rmsnorm", mlp="swiglu", norm_eps=1e-6))
    assert isinstance(llama.blocks[0].norm1, torch.nn.RMSNorm) and isinstance(llama.norm_f, torch.nn.RMSNorm)
    assert llama.norm_f.eps == 1e-6 and {n for n, _ in llama.blocks[0].ffn.named_children()} >= {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    with pytest.raises(ConfigError, match="model.norm"):
        tiny_config("rope", norm="batchnorm")
    with pytest.raises(ConfigError, match="model.mlp"):
        tiny_config("rope", mlp="geglu")


@pytest.mark.slow
def test_an_imported_llama_fine_tunes_with_yarn_and_evaluates_at_4x(tmp_path: Path, monkeypatch) -> None:
    """The context-extension workflow on the CPU: a random Llama with a word-level tokenizer, saved
    locally, imported with YaRN (factor 4 over 32 tokens), fine-tuned a few steps by ``posformer.train``
    (``init_from=``, the run reading the folder's tokenizer), then scored at 1x, 2x and 4x by the
    harness (``posformer.evaluate``)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    import posformer

    monkeypatch.chdir(tmp_path)
    random.seed(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "while", "birds"]
    lines = (" ".join(random.choice(words) for _ in range(12)) for _ in range(400))
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *sorted(set(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_dir = tmp_path / "llama"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(hf_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_len": 32}
    ckpt = hf_to_checkpoint(hf_dir, tmp_path / "imported" / "llama.ckpt", scaling=yarn)
    cfg = ModelConfig(**read_checkpoint(ckpt)["hyper_parameters"]["model"])
    model = [
        f"model.{k}={getattr(cfg, k)}"
        for k in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "norm", "norm_eps", "mlp", "bias")
    ]
    model += [
        f"model.tie_embeddings={cfg.tie_embeddings}",
        "model.dropout=0.0",
        f"model.pe_options={{base: {cfg.pe_options['base']}, scaling: {{type: yarn, factor: 4.0, "
        "original_max_len: 32}}",
    ]
    result = posformer.train(
        [
            f"init_from={ckpt}",
            "data=text",
            "data.path=corpus.txt",
            f"data.tokenizer={hf_dir}",
            "data.block_size=32",
            "data.eval_lengths=[32]",
            "data.eval_tokens=512",
            *model,
            "logger=none",
            "callbacks.pe_heatmap=null",
            "callbacks.lr_monitor=null",
        ],
        pe="rope",
        trainer={"accelerator": "cpu", "precision": "32-true", "max_steps": 6},
    )
    ev = posformer.evaluate(
        result.run_dir, lengths=[32, 64, 128], n_tokens=512, output_dir="eval_yarn", overrides=["trainer=cpu"]
    )
    ppl = next(iter(ev.metric("ppl", mode="nonoverlap").values()))
    assert sorted(ppl) == [32, 64, 128] and all(0 < v < len(vocab) for v in ppl.values()), ppl

"""Model configuration: a plain dataclass, validated on construction (:meth:`ModelConfig.validate`).

The value sets and ranges of single fields are declared on the fields (:func:`posformer.rules.ruled`:
the rules the config schema uses too); :meth:`ModelConfig.validate` checks them and, by hand, what
combines fields or needs the PE registry or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from posformer.errors import ConfigError
from posformer.model.backends.flex import available as flex_available
from posformer.model.knobs import model_knobs
from posformer.model.policy import ATTENTION_BACKENDS
from posformer.model.schedule import (
    DEFAULT_KIND,
    PLACES,
    LayerKind,
    check_kind_here,
    check_layers_keys,
    layer_plan,
    parse_kinds,
)
from posformer.pe import DEFAULT_ENCODING, encoding_options, get_encoding_class
from posformer.rules import POSITIVE_INT, between, one_of, positive, rule_problems, ruled

MODEL_KINDS = ("decoder", "encoder_decoder")
#: where ``model.pe`` acts when ``model.pe_apply`` does not say (the literature's defaults, see ModelConfig)
PE_APPLY = {"encoder": True, "decoder": True, "cross": False}
#: the attention backend's note in its error line
_BACKEND_NOTE = "(auto: FlexAttention on CUDA, SDPA elsewhere)"


@dataclass
class ModelConfig:
    """Hyper-parameters of both models.

    ``pe_apply`` says where the PE is used: ``encoder`` (encoder input or encoder self-attention),
    ``decoder`` (decoder input or decoder self-attention) and ``cross`` (encoder-decoder attention;
    only meaningful for rotary and bias PEs). Defaults follow the literature: absolute PEs on both
    inputs (Vaswani et al.), rotary/bias PEs in self-attention only (T5, ALiBi, RoPE practice).
    """

    kind: str = ruled("decoder", one_of(*MODEL_KINDS))
    vocab_size: int = ruled(256, POSITIVE_INT)
    src_vocab_size: int | None = None  # encoder-decoder; default: vocab_size
    d_model: int = ruled(256, POSITIVE_INT)
    n_heads: int = ruled(4, POSITIVE_INT)
    n_layers: int = ruled(4, POSITIVE_INT)  # decoder-only depth
    n_encoder_layers: int = ruled(6, POSITIVE_INT)
    n_decoder_layers: int = ruled(6, POSITIVE_INT)
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = ruled(0.1, between(0.0, 1.0))
    attn_dropout: float = ruled(0.0, between(0.0, 1.0))
    activation: str = ruled("gelu", one_of("relu", "gelu"))
    norm_first: bool | None = None  # pre-LN; default: True for decoder-only, False (post-LN) for enc-dec
    # token embeddings x sqrt(d_model); default (None): True for encoder-decoder (Vaswani et al. 3.4),
    # False for decoder-only (GPT-2, x-transformers): see ``init`` and docs/results.md, "Parity"
    scale_embedding: bool | None = None
    # output projection = token embedding; default (None): True for encoder-decoder (Vaswani et al.
    # 3.4), False for decoder-only (x-transformers, Llama)
    tie_embeddings: bool | None = None
    share_src_tgt_embedding: bool = False
    pad_id: int = 0
    bias: bool = True
    # the block's normalization: "layernorm" (nn.LayerNorm, weight and bias) or "rmsnorm" (nn.RMSNorm,
    # weight only; Llama, Mistral, Qwen); ``norm_eps`` is either's epsilon (1e-5: nn.LayerNorm's default)
    norm: str = ruled("layernorm", one_of("layernorm", "rmsnorm"))
    norm_eps: float = ruled(1e-5, positive())
    # the feed-forward: "mlp" (fc1 -> ``activation`` -> fc2) or "swiglu" (Shazeer 2020; Llama's
    # down(silu(gate(x)) * up(x)), ``d_ff`` wide; ``activation`` is then unused)
    mlp: str = ruled("mlp", one_of("mlp", "swiglu"))
    # weight init: "xavier" (xavier-uniform Linear; N(0, d^-1/2) embeddings, N(0, 0.02) unscaled) or
    # "torch" (PyTorch's nn.Linear defaults + kaiming-normal embeddings, std sqrt(2/d), as
    # x-transformers). Default (None): "xavier" for encoder-decoder (the 2017 recipe), "torch" for
    # decoder-only -- with unscaled embeddings the pre-LN residual stream starts at std sqrt(2/d)
    # instead of 1, which closed posformer's gap to x-transformers (docs/results.md, "Parity").
    init: str | None = ruled(None, one_of("xavier", "torch"))  # checked once resolved (__post_init__)
    pe: str = DEFAULT_ENCODING
    pe_options: dict[str, Any] = field(default_factory=dict)
    pe_apply: dict[str, bool] = field(default_factory=lambda: dict(PE_APPLY))
    attention_chunk_mb: int = 256
    # auto | flex | sdpa: FlexAttention (model/backends/flex.py)
    attention_backend: str = ruled("auto", one_of(*ATTENTION_BACKENDS, note=_BACKEND_NOTE))
    # per-layer schedules (model/schedule.py): named kinds (PE, span, temperature, sinks) and their
    # layout over each place's layers; empty: every layer is today's (the model's PE, full attention)
    layer_kinds: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] = field(default_factory=dict)
    # attention knobs for every layer (model/knobs.py: qk_norm, output_gate, softcap, ssmax); a layer
    # kind's own setting wins; empty: every knob off (today's model)
    attention_knobs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        decoder_only = self.kind == "decoder"
        if self.scale_embedding is None:  # the model kind's recipe, resolved once (and so saved)
            self.scale_embedding = not decoder_only
        if self.tie_embeddings is None:
            self.tie_embeddings = not decoder_only
        if self.init is None:
            self.init = "torch" if decoder_only else "xavier"
        self.validate()

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def token_init_std(self) -> float:
        """Std of the token-embedding weights at init: kaiming sqrt(2/d) ("torch"), else N(0, d^-1/2)
        when scaled by sqrt(d), N(0, 0.02) when not."""
        if self.init == "torch":
            return (2.0 / self.d_model) ** 0.5
        return self.d_model**-0.5 if self.scale_embedding else 0.02

    @property
    def embedding_std(self) -> float:
        """Std of the token embeddings entering the model at init (after any sqrt(d) scaling).

        1 for the 2017 recipe (exactly, so that path stays bitwise the paper's sum); sqrt(2/d) for
        decoder-only. An ``embed`` PE works in units of it (``_Base._embed`` in model/transformer.py).
        """
        if self.init == "xavier" and self.scale_embedding:
            return 1.0
        return self.token_init_std * (self.d_model**0.5 if self.scale_embedding else 1.0)

    @property
    def pre_ln(self) -> bool:
        return self.norm_first if self.norm_first is not None else self.kind == "decoder"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def places(self) -> tuple[str, ...]:
        """The attention places of this model kind."""
        return ("decoder",) if self.kind == "decoder" else PLACES

    def depth(self, place: str) -> int:
        """Layers of ``place``: decoder-only ``n_layers``; encoder-decoder its encoder/decoder depth."""
        if self.kind == "decoder":
            return self.n_layers
        return self.n_encoder_layers if place == "encoder" else self.n_decoder_layers

    def pe_applies(self, place: str) -> bool:
        """Whether ``model.pe`` acts at ``place`` (``encoder``, ``decoder``, ``cross``): ``model.pe_apply``,
        else :data:`PE_APPLY` (the encoder and decoder, not cross-attention)."""
        return bool(self.pe_apply.get(place, PE_APPLY[place]))

    def layer_plan(self, place: str) -> tuple[LayerKind, ...] | None:
        """The kind of every layer of ``place`` (``None``: no schedule, today's layers)."""
        return layer_plan(parse_kinds(self.layer_kinds), self.layers, place, self.depth(place))

    def plan(self, place: str) -> tuple[LayerKind, ...]:
        """The kind of every layer of ``place``: :meth:`layer_plan`, or :data:`DEFAULT_KIND` throughout."""
        plan = self.layer_plan(place) or (DEFAULT_KIND,) * self.depth(place)
        wide = model_knobs(self.attention_knobs)
        if not wide.active and not any(k.knobs.active for k in plan):
            return plan
        return tuple(replace(k, knobs=k.knobs.over(wide)) for k in plan)

    def kind_pe(self, kind: LayerKind) -> tuple[str, dict[str, Any]]:
        """The PE name and options of a kind with its own PE (options merged over the model's when the
        kind keeps the model's PE)."""
        if kind.pe is None:
            return self.pe, {**self.pe_options, **(kind.pe_options or {})}
        return kind.pe, dict(kind.pe_options or {})

    def _check_model_pe_trains(self, kinds: Mapping[str, LayerKind]) -> None:
        """``model.pe`` must be the PE of some layer: refuse it when every layer's kind names its own PE
        and none of them is ``model.pe`` (it would train nowhere while the run is labelled with it)."""
        plans = {place: layer_plan(kinds, self.layers, place, self.depth(place)) for place in self.places}
        if any(plan is None for place, plan in plans.items() if place != "cross"):
            return  # a place without a schedule uses model.pe in every layer
        used = [k for plan in plans.values() for k in plan or ()]
        hooks = get_encoding_class(self.pe).capabilities.hooks
        if any(k.pe is None for k in used) or "embed" in hooks:
            return
        own = dict.fromkeys(f"{k.name}: {k.pe}" for k in used)
        if self.pe in {k.pe for k in used} or not hooks:  # a PE without hooks: nothing to train or drop
            return
        first = used[0].name
        raise ConfigError(
            f"model.pe={self.pe!r} trains no layer: every layer's kind names its own PE "
            f"({', '.join(own)}), so {self.pe} would be ignored while the run is labelled {self.pe}. Drop "
            f"pe={self.pe} (the kinds' PEs then train and label the run), set it per kind "
            f"(model.layer_kinds.{first}.pe={self.pe} with its pe_options), or use a model without layer "
            "kinds (model=decoder_tiny)."
        )

    def _validate_schedule(self) -> None:
        """Layer kinds and their layout: names, lengths, spans, temperatures, and each kind's PE."""
        check_layers_keys(self.layers, self.places)
        kinds = parse_kinds(self.layer_kinds)
        for place in self.places:
            for kind in dict.fromkeys(layer_plan(kinds, self.layers, place, self.depth(place)) or ()):
                name, options = self.kind_pe(kind) if kind.own_pe else (self.pe, {})
                cls = get_encoding_class(name)
                check_kind_here(kind, place, cls.capabilities.hooks, name)
                if kind.switch is not None:
                    target = get_encoding_class(kind.switch.pe)
                    check_kind_here(
                        replace(kind, name=f"{kind.name}.switch", pe=kind.switch.pe),
                        place,
                        target.capabilities.hooks,
                        kind.switch.pe,
                    )
                    bad = sorted(set(kind.switch.pe_options) - set(encoding_options(target)))
                    if bad:
                        raise ConfigError(
                            f"model.layer_kinds.{kind.name}.switch.pe_options: pe={kind.switch.pe!r} has no "
                            f"option(s) {', '.join(bad)}; valid options: "
                            f"{', '.join(encoding_options(target)) or 'none'}."
                        )
                unknown = sorted(set(options) - set(encoding_options(cls)))
                if unknown:
                    raise ConfigError(
                        f"model.layer_kinds.{kind.name}.pe_options: pe={name!r} has no option(s) "
                        f"{', '.join(unknown)}; valid options: {', '.join(encoding_options(cls)) or 'none'}."
                    )
        self._check_model_pe_trains(kinds)

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a bad field or combination.

        The single home of model-config checks: the fields' declared rules (kind, sizes, dropout
        ranges, ``init``, ``activation``, ``attention_backend``), then by hand ``d_model % n_heads``,
        the PE name, ``pe_apply``, FlexAttention's availability and ``pad_id``; ``posformer.configs.checks``
        builds a ``ModelConfig`` to run them. Checks against the PE class's hooks (``pe_apply``) and
        the shared source/target vocabulary run in the model constructors, when the model is built.
        """
        problems = rule_problems(self, "model.")
        if problems:
            raise ConfigError(problems[0])
        if self.d_model % self.n_heads:
            example = self.n_heads * max(1, round(self.d_model / self.n_heads))
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; pick "
                f"d_model as a multiple of n_heads (e.g. {example})."
            )
        get_encoding_class(self.pe)  # unknown PE: ConfigError listing the valid names
        unknown = set(self.pe_apply) - {"encoder", "decoder", "cross"}
        if unknown:
            raise ConfigError(
                f"model.pe_apply has unknown keys {sorted(unknown)}; valid: encoder, decoder, cross."
            )
        for key, value in self.pe_apply.items():
            if not isinstance(value, bool):
                raise ConfigError(f"model.pe_apply.{key}={value!r} must be true or false.")
        self._validate_schedule()
        model_knobs(self.attention_knobs)
        if self.attention_backend == "flex" and not flex_available():
            raise ConfigError(
                f"model.attention_backend=flex needs torch.nn.attention.flex_attention, which torch "
                f"{torch.__version__} lacks; use model.attention_backend=auto or sdpa, or torch >= 2.5."
            )
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(
                f"model.pad_id={self.pad_id} must be a token id in [0, vocab_size={self.vocab_size})."
            )


# ------------------------------------------------------------------------------------------ naming
def _runs(names: list[str]) -> str:
    """``[a, a, a, b]`` -> ``a×3+b×1``; a sequence that repeats a shorter period whole is written once
    with its count: ``[a, a, b, a, a, b]`` -> ``(a×2+b×1)×2``."""

    def rle(seq: list[str]) -> str:
        out: list[list[Any]] = []
        for name in seq:
            if out and out[-1][0] == name:
                out[-1][1] += 1
            else:
                out.append([name, 1])
        return "+".join(f"{n}×{k}" for n, k in out)

    for period in range(1, len(names)):
        if len(names) % period == 0 and names == names[:period] * (len(names) // period):
            inner = rle(names[:period])
            if "+" in inner:  # one PE repeated is a run already: rope×6, not (rope×1)×6
                return f"({inner})×{len(names) // period}"
            break
    return rle(names)


def describe_schedule(model: Mapping[str, Any]) -> str:
    """The PE of a model for titles and labels: ``model.pe`` unchanged without a per-layer schedule; with
    one, the PE of each layer, runs collapsed (``rope×3+nope×1``), the layer kinds added in brackets when
    the PE names alone do not tell them apart (``rope×6 [local×5+global×1]``), and per place for an
    encoder-decoder (``encoder rope×6 / decoder rope×3+nope×3``). ``model``: the model config as a
    mapping (a checkpoint's ``hyper_parameters["model"]``, :func:`posformer.configs.settings.read_train`)."""
    pe = str(model.get("pe", DEFAULT_ENCODING))
    kinds = parse_kinds(model.get("layer_kinds"))
    layers = model.get("layers")
    if not layers:
        return pe
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    n = {k: int(model.get(k) or defaults[k]) for k in ("n_layers", "n_encoder_layers", "n_decoder_layers")}
    decoder_only = model.get("kind", "decoder") == "decoder"
    depth = (
        {"decoder": n["n_layers"]}
        if decoder_only
        else {
            "encoder": n["n_encoder_layers"],
            "decoder": n["n_decoder_layers"],
            "cross": n["n_decoder_layers"],
        }
    )
    parts = []
    for place, layers_here in depth.items():
        plan = layer_plan(kinds, layers, place, layers_here)
        if plan is None:
            if place != "cross":  # cross-attention without a schedule: as model.pe_apply says, not named
                parts.append((place, f"{pe}×{layers_here}"))
            continue
        pes = _runs([k.pe if k.pe is not None else pe for k in plan])
        names = _runs([k.name for k in plan])
        parts.append((place, pes if names.count("×") <= pes.count("×") else f"{pes} [{names}]"))
    if decoder_only:
        return parts[0][1]
    return " / ".join(f"{place} {text}" for place, text in parts)

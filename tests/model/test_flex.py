"""The FlexAttention backend (posformer/model/backends/flex.py) and the elementwise bias contract.

CPU (default suite): the eager ``flex_attention`` (no compile; it materialises the scores) against
the materialised SDPA backends and an explicit softmax, forward only, for every PE the backend
applies to, with and without causal, padding and document masks; the backend choice
(``auto``/``flex``/``sdpa``), the fallback without FlexAttention and the refusals. ``slow``: the
compiled CPU kernel. ``cuda`` (skipped without a device; ``scripts/gpu_check.sh``): forward and
gradients, fp32 and bf16, compiled, and no recompilation across lengths; of the full PE x causal x
masks x dtype grid, three representative cases per PE run by default (15 today) and the rest is also
``slow``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from posformer.configs.settings import read_train
from posformer.errors import ConfigError
from posformer.model import AttentionContext, ModelConfig, attend
from posformer.model.backends import BackendPolicy, choose, flex
from posformer.model.positions import document_positions
from posformer.pe import ENCODINGS, PerCall, PositionalEncoding, build_encoding, check_class, list_encodings
from posformer.pe.forms import reads

CUDA = torch.cuda.is_available()


def _pe(name: str, causal: bool, heads: int = 2, dh: int = 8) -> Any:
    """A PE with perturbed parameters (so learned biases are not ~0), or None for ``nope``."""
    torch.manual_seed(3)
    pe = build_encoding(name, d_model=heads * dh, n_heads=heads, causal=causal, n_layers=2)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe if pe.caps.in_attention else None


def _flex_pes() -> list[str]:
    """PEs whose attention FlexAttention computes: no value hook; a bias only if elementwise."""
    out = []
    for name in list_encodings():
        pe = build_encoding(name, d_model=16, n_heads=2, causal=True)
        if "value" not in pe.caps.hooks and (pe.caps.bias is None or pe.caps.bias.score_mod):
            out.append(name)
    return out


def _untrained(cls: type) -> Any:
    """``cls``'s capabilities with ``trainable`` taken from its bias form (its bias_fn undeclared)."""
    return replace(cls.capabilities, bias=replace(cls.capabilities.bias, trainable=False))


FLEX_PES = _flex_pes()
ELEMENTWISE = [n for n in list_encodings() if (f := ENCODINGS[n].capabilities.bias) and f.score_mod]
MASKS = ("none", "padding", "documents")


def _case(name: str, causal: bool, masks: str, batch: int = 2, t: int = 24, device: str = "cpu") -> tuple:
    """(pe, q_pos, ctx keyword arguments) of one test case."""
    pe = _pe(name, causal)
    pos = torch.arange(t, device=device)[None]
    kw: dict[str, Any] = {}
    if masks == "padding":
        pad = torch.ones(batch, t, dtype=torch.bool, device=device)
        pad[1, -5:] = False  # right padding: every query still sees a real key
        kw["key_padding_mask"] = pad
    elif masks == "documents":
        seg = torch.zeros(batch, t, dtype=torch.long, device=device)
        seg[0, 10:], seg[1, 5:], seg[1, 15:] = 1, 1, 2
        kw["segment_ids"] = seg
        pos = document_positions(seg)
    if pe is not None:
        pe = pe.to(device)
    return pe, pos, kw


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Reference: fp32 ``softmax(q·kᵀ/√d + bias, hidden keys -inf)·v`` from the context's bias and keep."""
    tq, tk = q.shape[2], k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if ctx.has_bias:
        scores = scores + ctx.bias(0, tq, tk, q, 0, k)
    keep = ctx.keep(0, tq, tk, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v.float()


def _chosen(q: torch.Tensor, k: torch.Tensor, ctx: AttentionContext, dropout_p: float = 0.0) -> str:
    """Name of the backend :func:`attend` runs for this call on ``q``'s device."""
    return choose(q, k, ctx, dropout_p=dropout_p, device_type=q.device.type)


def _policy(choice: str, compiled: bool = True) -> BackendPolicy:
    return BackendPolicy(choice=choice, flex_compiled=compiled)


@pytest.fixture
def eager() -> None:
    """Quiet about the eager ``flex_attention`` (the tests pass ``flex_compiled=False``)."""
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


# ---------------------------------------------------------------------- the elementwise contract
@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("causal", [True, False])
def test_bias_fn_is_elementwise(name: str, causal: bool) -> None:
    """bias() (B, H, Tq, Tk) equals bias_fn on scattered single (h, i, j) triples, incl. per-row and
    fractional positions: the function really is elementwise."""
    pe = _pe(name, causal)
    q_pos = torch.tensor([[0, 3, 4, 9, 20], [1, 2, 3, 4, 5]])
    k_pos = torch.tensor([[0, 2, 7, 9, 20, 33], [0, 1, 2, 3, 4, 5]])
    for qp, kp in ((q_pos, k_pos), (q_pos.float() * 0.5, k_pos.float() * 0.5)):
        with torch.no_grad():
            full = pe.bias(qp, kp, layer=1)  # (2, H, 5, 6)
            b, h, i, j = (torch.randint(0, n, (40,)) for n in full.shape)
            at = pe.bias_fn(1)(h, qp[b, i], kp[b, j])  # (40,)
        torch.testing.assert_close(at, full[b, h, i, j], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("name", "causal"),
    [  # each case compiles score_mod with dynamo (0.4-1.3 s): FIRE causal (the eps regression) stays fast
        pytest.param(name, causal, marks=() if (name, causal) == ("fire", True) else pytest.mark.slow)
        for name in ELEMENTWISE
        for causal in (True, False)
    ],
)
def test_score_mod_graph_inputs_are_device_tensors(name: str, causal: bool) -> None:
    """The compiled ``score_mod`` (dynamic shapes, as on CUDA) reads only float32/int tensors and
    SymInts: a Python float in a bias_fn closure becomes a CPU float64 input, which FlexAttention's
    CUDA lowering cannot read (FIRE's ``eps`` did, on an H200 with torch 2.11)."""
    if ENCODINGS[name].causal_only and not causal:
        pytest.skip(f"{name} is causal-only")
    pe = _pe(name, causal).requires_grad_(False)
    seen: list[list[Any]] = []

    def capture(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        seen.append(list(inputs))
        return gm.forward

    torch._dynamo.reset()
    kernel = torch.compile(flex.flex_attention, backend=capture, dynamic=True)
    pos = torch.arange(24)[None]
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel(q, k, v, score_mod=flex.score_mod(AttentionContext(pe, pos, pos, causal=causal), 0, 1))
    assert seen, "nothing was compiled"
    for x in seen[0]:
        assert isinstance(x, (torch.Tensor, torch.SymInt, int)), f"{name}: graph input {type(x).__name__}"
        if isinstance(x, torch.Tensor):
            assert x.dtype != torch.float64, f"{name}: a float64 graph input {tuple(x.shape)}"


def test_elementwise_bias_excludes_reading_tensors() -> None:
    """A bias_fn is a function of positions: a form that reads the call's tensors never calls it."""
    attrs = {"bias_form": PerCall(reads=frozenset({"q"})), "bias": lambda *a, **k: None}
    cls = type("ReadsAndElementwise", (PositionalEncoding,), {**attrs, "bias_fn": lambda self, layer=0: None})
    with pytest.raises(TypeError, match="defines bias_fn"):
        check_class(cls)


@pytest.mark.parametrize("causal", [True, False])
def test_fire_flex_form_has_the_mlp_gradients(causal: bool) -> None:
    """With gradients FIRE's bias_fn (differentiable segments) gives the MLP's bias and parameter
    gradients."""
    pe = _pe("fire", causal)
    pos = torch.arange(30)[None]
    weight = torch.randn(1, pe.n_heads, 30, 30)
    grads = []
    for bias in (
        lambda: pe.bias(pos, pos),  # with grads: the MLP
        lambda: pe.bias_fn()(
            torch.arange(pe.n_heads).view(1, -1, 1, 1), pos[:, None, :, None], pos[:, None, None]
        ),
    ):
        pe.zero_grad()
        out = bias()
        (out * weight).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in pe.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- equality, CPU, no grad
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", FLEX_PES)
def test_flex_forward_equals_sdpa_and_explicit(name: str, causal: bool, masks: str, eager: None) -> None:
    if ENCODINGS[name].causal_only and not causal:
        pytest.skip(f"{name} is causal-only")
    pe, pos, kw = _case(name, causal, masks)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, pos.shape[1], 8) for _ in range(3))
    with torch.no_grad():
        flex_ctx = AttentionContext(pe, pos, pos, causal=causal, policy=_policy("flex", False), **kw)
        sdpa_ctx = AttentionContext(pe, pos, pos, causal=causal, policy=_policy("sdpa"), **kw)
        # forced: Flex runs unless fused SDPA needs no mask at all (no bias, no padding/documents)
        assert _chosen(q, k, flex_ctx) == "flex" or (pe is None or not flex_ctx.has_bias) and not kw
        assert flex.wanted(q, k, flex_ctx, dropout_p=0.0, device_type="cpu")
        assert _chosen(q, k, sdpa_ctx) != "flex"
        out_flex, out_sdpa = flex.run(q, k, v, flex_ctx, 0, 0.0), attend(q, k, v, sdpa_ctx)
        ref = _explicit(q, k, v, sdpa_ctx)
    torch.testing.assert_close(out_flex, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_sdpa, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["fire", "alibi", "rope", "forget_alibi"])
def test_model_forward_flex_equals_sdpa(name: str, tiny_model: Any, eager: None) -> None:
    """Whole tiny models (same weights): forced Flex = SDPA, with padding and with packed documents."""
    ids = torch.randint(1, 13, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, -4:] = False
    seg = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    flex_model, sdpa_model = (
        tiny_model(name, attention_backend="flex"),
        tiny_model(name, attention_backend="sdpa"),
    )
    flex_model.attention_policy = _policy("flex", compiled=False)
    with torch.no_grad():
        for kw in ({"attention_mask": mask}, {"segment_ids": seg}):
            torch.testing.assert_close(flex_model(ids, **kw), sdpa_model(ids, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "sandwich"])
def test_an_offset_bias_computed_per_score_equals_the_offset_vector(
    name: str, tiny_model: Any, monkeypatch: pytest.MonkeyPatch, eager: None
) -> None:
    """``BackendPolicy(flex_offsets=False)`` (``posformer-bench --before flex_offsets``): Flex evaluates
    the PE's ``bias_fn`` per score instead of reading the captured offset vector; the forms differ
    (recorded; Sandwich has no ``bias_fn`` and keeps the vector) and the outputs agree with each other
    and with SDPA, fp32 1e-5, plain and padded."""
    from posformer.model.backends import flex

    forms: list[str | None] = []
    form = flex.bias_form
    monkeypatch.setattr(flex, "bias_form", lambda ctx: forms.append(form(ctx)) or forms[-1])
    ids = torch.randint(1, 13, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # a left-padded row: the positions stay contiguous
    model = tiny_model(name, attention_backend="flex")
    reference = tiny_model(name, attention_backend="sdpa")
    outs = {}
    with torch.no_grad():
        for offsets in (True, False):
            model.attention_policy = BackendPolicy(choice="flex", flex_compiled=False, flex_offsets=offsets)
            forms.clear()
            outs[offsets] = [model(ids), model(ids, attention_mask=mask)]
            per_score = not offsets and model.pe.caps.bias.score_mod
            assert set(forms) == {"elementwise" if per_score else "offsets"}, forms
        want = [reference(ids), reference(ids, attention_mask=mask)]
    for got_vec, got_fn, ref in zip(outs[True], outs[False], want, strict=True):
        torch.testing.assert_close(got_fn, got_vec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_fn, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- which backend runs
def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    pos = torch.arange(32)[None]
    q = torch.randn(1, 2, 32, 8)
    fire, alibi = _pe("fire", True), _pe("alibi", True)

    def ctx(pe: Any, backend: str) -> AttentionContext:
        return AttentionContext(pe, pos, pos, causal=True, policy=_policy(backend))

    monkeypatch.setattr(flex, "cpu_compiles", lambda: True)  # this machine compiles (not tried here)
    with torch.no_grad():
        assert _chosen(q, q, ctx(fire, "auto")) == "masked"  # CPU, short: today's path
        monkeypatch.setattr(flex, "CPU_MIN_KEYS", 32)
        assert _chosen(q, q, ctx(fire, "auto")) == "flex"  # CPU, no grad, long enough, not offset-only
        assert _chosen(q, q, ctx(alibi, "auto")) == "offset"  # offset-only: the offset vector is faster
        assert _chosen(q, q, ctx(alibi, "flex")) == "flex"  # forced
        assert _chosen(q, q, ctx(fire, "sdpa")) == "masked"  # forced off
        assert _chosen(q, q, ctx(fire, "auto"), dropout_p=0.1) == "masked"  # Flex has no dropout
        for name in ("shaw", "cope"):  # biases that read q or k: never Flex
            assert _chosen(q, q, ctx(_pe(name, True), "flex")) != "flex"
        # a bias of the layer input's features (forget gates) has a Flex form: forced, it runs there
        assert _chosen(q, q, ctx(_pe("forget_alibi", True), "flex")) == "flex"
        assert _chosen(q, q, ctx(_pe("forget_alibi", True), "auto")) != "flex"  # CPU auto: unchanged
    qg = q.clone().requires_grad_()
    assert _chosen(qg, qg, ctx(fire, "auto")) == "masked"  # CPU with gradients: no Flex backward
    with pytest.raises(ConfigError, match="attention_backend=flex needs a CUDA device for gradients"):
        _chosen(qg, qg, ctx(fire, "flex"))


def test_fallback_without_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FlexAttention (old torch): auto runs today's path with the same result; forcing it is
    refused in one line when the config is built."""
    pe = _pe("fire", True)
    pos = torch.arange(20)[None]
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    monkeypatch.setattr(flex, "CPU_MIN_KEYS", 1)
    monkeypatch.setattr(flex, "cpu_compiles", lambda: True)
    with torch.no_grad():
        ctx = AttentionContext(pe, pos, pos, causal=True)
        assert _chosen(q, k, ctx) == "flex"
        monkeypatch.setattr(flex, "flex_attention", None)
        assert _chosen(q, k, ctx) == "masked"
        out = attend(q, k, v, ctx)
        torch.testing.assert_close(out, _explicit(q, k, v, ctx), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="attention_backend=flex needs torch.nn.attention.flex_attention"):
        ModelConfig(attention_backend="flex")


def test_attention_backend_validated(tiny_config: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"model.attention_backend='fast' is unknown; valid: auto, flex, sdpa"
    ):
        tiny_config("fire", attention_backend="fast")
    assert tiny_config("fire", attention_backend="sdpa").attention_backend == "sdpa"


def test_training_with_flex_on_cpu_refused(tiny_model: Any) -> None:
    """Before any work (composed-config validation), and at the first training forward."""
    cfg = {"model": {"attention_backend": "flex"}, "trainer": {"accelerator": "cpu"}}
    with pytest.raises(ConfigError, match="model.attention_backend=flex trains only on CUDA"):
        read_train(shipped_with(cfg))
    model = tiny_model("fire", attention_backend="flex").train()
    with pytest.raises(ConfigError, match="needs a CUDA device for gradients"):
        model(torch.randint(1, 13, (1, 6)))


@pytest.mark.parametrize(
    ("pe", "undeclared", "refused"),
    [("t5", False, False), ("fire", False, False), ("fire", True, True), ("alibi", False, False)],
)
def test_training_an_undeclared_learned_bias_with_flex_is_refused_before_any_work(
    pe: str, undeclared: bool, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Learned biases whose form states ``trainable`` train through Flex; one that does not (FIRE with
    the fact taken away) is refused by the config check, for training only."""
    if undeclared:
        monkeypatch.setattr(ENCODINGS[pe], "capabilities", _untrained(ENCODINGS[pe]))
    cfg = {"model": {"attention_backend": "flex", "pe": pe, "d_model": 16, "n_heads": 2}, "seed": 0}
    problems = validate_problems(cfg)
    assert any("cannot train the parameters of pe=" in line for line in problems) is refused
    evaluation_only = validate_problems({**cfg, "train": False})
    assert not any("cannot train the parameters" in line for line in evaluation_only)


def shipped_with(values: dict[str, Any]) -> Any:
    """The shipped ``posformer-train`` config (``configs/train.yaml``) with ``values`` merged over it;
    ``model.pe`` is chosen as the ``pe`` group's option (the PE's own options with it)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    model = dict(values.get("model", {}))
    pe = [f"pe={model.pop('pe')}"] if "pe" in model else []
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *pe])
    return OmegaConf.merge(cfg, {**values, "model": model})


def validate_problems(cfg: dict[str, Any]) -> list[str]:
    """The lines of :func:`read_train`'s error for the shipped config with ``cfg`` merged over it (empty
    when it passes)."""
    try:
        read_train(shipped_with(cfg))
    except ConfigError as exc:
        return str(exc).splitlines()
    return []


def test_flex_trains_a_learned_bias_only_where_its_pe_declares_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU (the decision asked for CUDA) the gate is the PE's capability, not a blanket refusal:
    a learned elementwise bias trains through Flex when its form states ``trainable``; taken
    away, forcing Flex is refused in one line and ``auto`` gives the call to the masked path; frozen, or
    without gradients, it is not refused. An offset-only bias trains through the offset vector at
    contiguous positions whatever it declares."""
    q = torch.randn(1, 2, 8, 16, requires_grad=True)  # (B, H, T, Dh): Dh 16, the GPU kernel's least
    pos, sparse = torch.arange(8)[None], torch.arange(8)[None] * 2

    def wanted(pe: Any, choice: str = "flex", positions: torch.Tensor = pos) -> bool:
        ctx = AttentionContext(pe, positions, positions, causal=True, policy=_policy(choice))
        return flex.wanted(q, q, ctx, dropout_p=0.0, device_type="cuda")

    fire, t5 = _pe("fire", True), _pe("t5", True)
    assert wanted(fire) and wanted(fire, "auto") and wanted(t5, "auto") and wanted(t5, "auto", sparse)
    for name in ("fire", "t5"):
        monkeypatch.setattr(ENCODINGS[name], "capabilities", _untrained(ENCODINGS[name]))
    with pytest.raises(ConfigError, match="cannot train the parameters of pe=fire's bias at these positions"):
        wanted(_pe("fire", True))
    assert not wanted(_pe("fire", True), "auto")
    assert wanted(_pe("t5", True), "auto")  # contiguous positions: the offset vector, one captured tensor
    assert not wanted(_pe("t5", True), "auto", sparse)  # scattered positions: bias_fn, undeclared
    with torch.no_grad():
        assert wanted(_pe("fire", True))
    assert wanted(_pe("fire", True).requires_grad_(False))


# ---------------------------------------------------------------------- compiled (CPU: slow)
@pytest.mark.slow
def test_compiled_cpu_flex_equals_sdpa_without_recompiling() -> None:
    """The compiled CPU kernel = SDPA for FIRE; a new context (new score_mod closure) of the same shape
    reuses the compiled kernel."""
    from torch._dynamo.utils import counters

    pe = _pe("fire", True, heads=2, dh=16)
    pos = torch.arange(256)[None]
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    with torch.no_grad():
        ref = attend(q, k, v, AttentionContext(pe, pos, pos, causal=True, policy=_policy("sdpa")))
        out = attend(q, k, v, AttentionContext(pe, pos, pos, causal=True, policy=_policy("flex")))
        frames = counters["stats"]["unique_graphs"]
        again = attend(q, k, v, AttentionContext(pe, pos, pos, causal=True, policy=_policy("flex")))
        assert counters["stats"]["unique_graphs"] == frames
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, out)


# ---------------------------------------------------------------------- CUDA
#: PEs of the CUDA comparison: every elementwise bias, and nope (the others reach attention as nope does)
CUDA_PES = [*ELEMENTWISE, "nope"]
#: (causal, dtype) in an order where any three consecutive entries hold both causal values and both dtypes
_CYCLE = ((True, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32))


def _cuda_cases() -> list[Any]:
    """The full grid PE x causal x masks x dtype; a representative subset runs by default, the rest is
    ``slow`` (``scripts/gpu_check.sh`` runs ``-m "cuda and not slow"``: every case compiles its own Flex
    forward, backward and block mask, so the grid took ~5 minutes).

    The subset: every PE with every mask kind (none / padding / documents), one case each; the (causal,
    dtype) of PE ``i`` with mask ``m`` is ``_CYCLE[(i + m) % 4]``, so every PE runs causal and
    bidirectional, fp32 and bf16, and (from 4 PEs on) every mask kind meets every (causal, dtype) pair.
    A causal-only PE takes the next causal pair of the cycle instead of a bidirectional one.
    """
    cases = []
    for i, name in enumerate(CUDA_PES):
        causal_only = name in ENCODINGS and ENCODINGS[name].causal_only
        for m, masks in enumerate(MASKS):
            cycle = [_CYCLE[(i + m + j) % len(_CYCLE)] for j in range(len(_CYCLE))]
            quick = next(c for c in cycle if c[0] or not causal_only)
            for causal in (True, False):
                for dtype in (torch.float32, torch.bfloat16):
                    marks = () if (causal, dtype) == quick else (pytest.mark.slow,)
                    kind = "causal" if causal else "bidirectional"
                    case_id = f"{name}-{kind}-{masks}-{'fp32' if dtype == torch.float32 else 'bf16'}"
                    cases.append(pytest.param(name, causal, masks, dtype, marks=marks, id=case_id))
    return cases


@pytest.fixture
def fresh_compiles() -> Iterator[None]:
    """An empty dynamo cache before and after the test: the production kernel (``flex.call_kernel``)
    allows ``flex.RECOMPILE_LIMIT`` graphs per process, and every case of the CUDA grid adds its own
    (PE x masks x dtype), so cases sharing a process must not add up."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("name", "causal", "masks", "dtype"), _cuda_cases())
def test_cuda_flex_equals_sdpa_forward_and_gradients(
    name: str, causal: bool, masks: str, dtype: torch.dtype, fresh_compiles: None
) -> None:
    """Flex = SDPA = explicit softmax on CUDA (compiled kernel): outputs and q/k/v gradients, the PE
    frozen (its parameter gradients through Flex: tests/model/test_flex_learned.py)."""
    if ENCODINGS[name].causal_only and not causal:
        pytest.skip(f"{name} is causal-only")
    pe, pos, kw = _case(name, causal, masks, t=200, device="cuda")
    if pe is not None:
        pe.requires_grad_(False)
    torch.manual_seed(0)
    base = [torch.randn(2, 2, pos.shape[1], 16, device="cuda", dtype=dtype) for _ in range(3)]
    results = []
    for backend in ("flex", "sdpa", "explicit"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        policy = BackendPolicy(choice="flex" if backend == "flex" else "sdpa")
        ctx = AttentionContext(pe, pos, pos, causal=causal, policy=policy, **kw)
        assert flex.wanted(q, k, ctx, dropout_p=0.0, device_type="cuda") == (backend == "flex")
        if backend == "flex":
            out = flex.run(q, k, v, ctx, 0, 0.0)
        else:
            out = _explicit(q, k, v, ctx).to(dtype) if backend == "explicit" else attend(q, k, v, ctx)
        out.float().square().sum().backward()
        results.append((out.float(), [t.grad.float() for t in (q, k, v)]))
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], **tol)
        for a, b in zip(results[0][1], other[1]):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("name", "masks"),
    [("alibi", "none"), ("fire", "padding"), ("forget_alibi", "documents"), ("nope", "documents")],
)
def test_cuda_divisible_lengths_give_the_kernel_without_bounds_checks_the_same_attention(
    name: str, masks: str, fresh_compiles: None
) -> None:
    """At 256 tokens (a multiple of 128) the kernel told ``IS_DIVISIBLE`` (``flex_divisible``, default)
    = the one that checks every tile's bounds = the explicit softmax: outputs and q/k/v gradients, fp32
    to 1e-4 (the offset vector, an elementwise bias with padding, the gates' features with documents,
    and documents alone)."""
    pe, pos, kw = _case(name, True, masks, t=256, device="cuda")
    if pe is not None:
        pe.requires_grad_(False)
    torch.manual_seed(0)
    base = [torch.randn(2, 2, 256, 16, device="cuda") for _ in range(3)]
    feats = torch.randn(2, 2, 256, 1, device="cuda").cumsum(2) * -0.1  # (B, H, T, 1): forget gates' sums
    results = []
    for hint in (True, False, None):  # None: the explicit softmax
        q, k, v = (t.clone().requires_grad_() for t in base)
        policy = BackendPolicy(choice="flex", flex_divisible=bool(hint))
        ctx = AttentionContext(pe, pos, pos, causal=True, policy=policy, **kw)
        if pe is not None and "x" in reads(pe.caps.bias):
            ctx.set_features(0, feats, feats)
        assert flex.divisible(q, k, policy) is (bool(hint) and q.is_cuda)  # (CPU rehearsal: never)
        out = flex.run(q, k, v, ctx, 0, 0.0) if hint is not None else _explicit(q, k, v, ctx)
        out.float().square().sum().backward()
        results.append((out.float(), [t.grad.float() for t in (q, k, v)]))
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], atol=1e-4, rtol=1e-4)
        for a, b in zip(results[0][1], other[1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_divisibility_hint_reaches_the_cuda_kernel_at_multiples_of_128() -> None:
    """``flex.divisible``: CUDA, both lengths multiples of 128, the policy's switch on; ``call_kernel``
    then hands the compiled kernel ``IS_DIVISIBLE``."""

    class Cuda:  # the facts divisible reads: the device type and the shape (B, H, T, Dh)
        def __init__(self, n: int, device: str = "cuda") -> None:
            self.device, self.shape = torch.device(device), (1, 2, n, 16)

    on, off = BackendPolicy(), BackendPolicy(flex_divisible=False)
    assert flex.divisible(Cuda(256), Cuda(384), on) and flex.divisible(Cuda(256), Cuda(256), None)
    assert not flex.divisible(Cuda(256), Cuda(200), on) and not flex.divisible(Cuda(256), Cuda(256), off)
    assert not flex.divisible(Cuda(256, "cpu"), Cuda(256, "cpu"), on)  # a static compile knows the lengths
    seen: list[dict] = []

    def compiled(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return q

    x = torch.empty(1, 2, 256, 16, device="meta")
    flex.call_kernel(compiled, x, x, x, is_divisible=True)
    flex.call_kernel(compiled, x, x, x, is_divisible=False)
    assert seen == [{"kernel_options": {"IS_DIVISIBLE": True}}, {}]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_auto_picks_flex_and_compiles_once_for_many_lengths(fresh_compiles: None) -> None:
    from torch._dynamo.utils import counters

    def chosen(q: torch.Tensor, k: torch.Tensor, ctx: AttentionContext) -> str:
        return choose(q, k, ctx, dropout_p=0.0, device_type="cuda")

    pe = _pe("fire", True, dh=16).cuda().requires_grad_(False)
    trained = _pe("fire", True, dh=16).cuda()  # a trainable bias_fn: auto trains it through Flex too
    seen = []
    for t in (256, 320, 384, 1000):
        pos = torch.arange(t, device="cuda")[None]
        q, k, v = (torch.randn(1, 2, t, 16, device="cuda", requires_grad=True) for _ in range(3))
        ctx = AttentionContext(pe, pos, pos, causal=True)
        assert chosen(q, k, ctx) == "flex"
        assert chosen(q, k, AttentionContext(trained, pos, pos, causal=True)) == "flex"
        attend(q, k, v, ctx).sum().backward()
        seen.append(counters["stats"]["unique_graphs"])
    assert seen[-1] - seen[1] <= 0, f"recompiled for new lengths: unique graphs {seen}"


def test_auto_never_picks_a_cpu_kernel_this_machine_cannot_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on the CPU asks once whether Flex compiles here (a tiny call: no C++ compiler, an inductor
    bug -> no) before choosing it, so a chosen backend never fails and falls back mid-forward."""

    def broken(device_type: str, compiled: bool) -> Any:
        def fail(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(flex, "kernel", broken)
    monkeypatch.setattr(flex, "CPU_MIN_KEYS", 1)
    flex.cpu_compiles.cache_clear()
    try:
        pe, pos = _pe("fire", True), torch.arange(20)[None]
        q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
        with torch.no_grad():
            ctx = AttentionContext(pe, pos, pos, causal=True)
            assert _chosen(q, k, ctx) == "masked" and not flex.cpu_compiles()
            torch.testing.assert_close(attend(q, k, v, ctx), _explicit(q, k, v, ctx), atol=1e-5, rtol=1e-5)
    finally:
        flex.cpu_compiles.cache_clear()

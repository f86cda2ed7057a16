"""Backend: FlexAttention (``torch.nn.attention.flex_attention``), the bias as a ``score_mod``.

The PE's bias comes from the same elementwise definition as the materialised one
(:meth:`~posformer.pe.base.PositionalEncoding.bias_fn`, a bias form with ``score_mod``)::

    score_mod(score, b, h, q_idx, kv_idx) = score + bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])

and the causal / padding / document masks (:meth:`AttentionContext.visible_fn`) become one
``BlockMask`` per context (``create_block_mask``; built once, shared by every layer), so hidden
blocks are skipped instead of filled with ``-inf``. Nothing of size (Tq, Tk) is materialised.

When it runs (``ModelConfig.attention_backend``, carried by ``ctx.policy``; :func:`wanted`, one rule a line):

* ``sdpa``: never. ``flex``: wherever it applies (no ``value`` hook, no dropout, a bias only if it
  has a Flex form, :func:`bias_form`; its parameters trained only where :func:`_trains_through_flex`);
  on the CPU only without gradients (FlexAttention has no CPU backward). A call it cannot take raises
  one clear error instead.
* ``auto``: on CUDA for a bias or packed documents, except single-query decoding steps (a one-row
  mask is cheaper than a block mask per step) and biases whose parameters it cannot train (a PE that
  does not state ``trainable`` in its bias form, at positions where the offset vector does not apply);
  a bias-free padded batch stays on SDPA's boolean mask. On the CPU only without gradients
  for a non-offset elementwise bias (FIRE) over at least :data:`CPU_MIN_KEYS` keys, where the
  compiled kernel beats the materialised path (FIRE at 16,384 keys: 1.92x; ``scripts/bench_attention.py
  --lengths 4096 16384 --pes fire shaw rope alibi``; docs/performance.md, "FIRE at long lengths");
  nowhere else.
* Unavailable (old torch without ``torch.nn.attention.flex_attention``): never; the other backends
  take every call.
* Heads smaller than :data:`CUDA_MIN_HEAD_DIM` (16) on CUDA: never (inductor's GPU kernel refuses them;
  ``flex`` raises one line naming the fix). The CPU kernel takes any head size.

Learned biases: a ``score_mod`` may read tensors that need gradients if each is read by
one index and none is 0-d (torch >= 2.6; a 0-d trainable scalar, or a tensor read whole, fails). The
offset form reads one such tensor, the context's offset vector, whose graph carries the gradient on to
the PE's parameters (T5, KERPLE, DPB, Sandwich at contiguous positions); elsewhere the PE's ``bias_fn``
reads its parameters that way when the PE states it (``trainable`` in its form: T5's table, KERPLE's
per-head ``r1``/``r2``, FIRE's per-head ``c``/``L`` and stacked segment slopes;
``tests/model/test_flex_learned.py``).

Compilation: ``torch.compile(flex_attention)`` once per process and device type (:func:`kernel`). On
CUDA with ``dynamic=True``: one kernel for every length (no recompile per step for variable lengths);
lengths that are multiples of 128 are passed as ``IS_DIVISIBLE`` (:func:`divisible`), which a static
compile would know, so those calls skip the per-tile bounds checks.
Each distinct *kind* of call compiles once: mask (none, causal, padding, documents) x bias (none or
the PE's) x dtype x grad mode x batch of 1 or more — a handful per model (the encoder-decoder's
evaluation over 26 batches of different lengths: 6, ``tests/model/test_flex_compiles.py``). At most
:data:`RECOMPILE_LIMIT` graphs are allowed; past that a call raises :class:`FlexRecompileError` (one
line: what, and ``model.attention_backend=sdpa`` as the fix) instead of torch's silent fallback to
eager Flex, which materialises every score and runs many times slower. Block masks that are compiled
(CUDA) count against the same limit (:func:`build_block_mask`), not torch's default of 8. Under
``auto`` such a failure, or any compile failure (:func:`is_compile_failure`), does not end the run:
:func:`posformer.model.attention.attend` records it in the model's
:class:`~posformer.model.policy.FlexFallback` and the model's remaining calls take SDPA or the
materialised paths; ``flex`` keeps the error. The backward is lowered at the forward
(``force_non_lazy_backward_lowering``), so its compile failures arrive where a call can still be
redone on another path. Inside a compiled model
(``compile.enabled=true``) ``flex_attention`` is called plainly: the model's compilation covers it.
On the CPU with static shapes: inductor's CPU template miscompiles the position gathers under
dynamic shapes (torch 2.13), so each distinct (Tq, Tk) compiles once (evaluation runs a few lengths).
``BackendPolicy(flex_compiled=False)`` runs the eager ``flex_attention`` (it materialises the scores;
the tests use it to check the CPU paths quickly).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError, PosformerError, is_kernel_out_of_resources, is_out_of_memory
from posformer.model.backends.sinks import rescale_by_sinks
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.model.schedule import Span
from posformer.pe.forms import Features, Offsets, Positions
from posformer.pe.shortcut import KeyVisible

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: the other backends take every call
    create_block_mask = flex_attention = None

#: CPU, ``auto``, no gradients: FlexAttention for elementwise biases over at least this many keys
CPU_MIN_KEYS = 16384
#: compiled FlexAttention graphs allowed for the compiled kernel (torch's default is 8 per function)
RECOMPILE_LIMIT = 16
#: inductor's Flex lowering compiles a kernel without per-tile bounds checks (``IS_DIVISIBLE``) when it
#: knows both lengths are multiples of this (torch's ``kernel/flex/flex_attention.py``): a static-shape
#: compile does; the dynamic one posformer runs on CUDA is told by :func:`divisible`
DIVISIBLE_BY = 128
#: the least head size of the CUDA kernel: Triton's ``tl.dot`` reduces over at least 16, so inductor
#: refuses smaller heads when it lowers Flex for a GPU ("NYI: embedding dimension ... at least 16"); the
#: CPU kernel takes any
CUDA_MIN_HEAD_DIM = 16


class FlexRecompileError(PosformerError, RuntimeError):
    """The compiled FlexAttention kernel needed more graphs than :data:`RECOMPILE_LIMIT`."""


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return flex_attention is not None


@functools.cache
def cpu_compiles() -> bool:
    """Whether FlexAttention compiles on this machine's CPU (a C++ compiler, no inductor bug): tried once
    on a tiny call, so ``auto`` never selects a kernel that then fails."""
    try:
        x = torch.ones(1, 1, 16, 16, device="cpu")  # (B, H, T, Dh): a tiny CPU call
        kernel("cpu", True)(x, x, x)
    except Exception:  # noqa: BLE001 - any failure means: not on this machine
        return False
    return True


def head_dim_fits(head_dim: int, device_type: str) -> bool:
    """Whether FlexAttention's kernel for ``device_type`` takes heads of size ``head_dim`` (Dh)."""
    return device_type != "cuda" or head_dim >= CUDA_MIN_HEAD_DIM


def bias_form(ctx: AttentionContext) -> str | None:
    """How FlexAttention reads this call's bias, from the PE's bias form (:mod:`posformer.pe.forms`):
    ``"none"`` (no bias), ``"offsets"`` (an ``Offsets`` bias at contiguous positions: one captured
    (H, Tq + Tk - 1) vector, the one the offset backend builds), ``"elementwise"`` (a form with
    ``score_mod``: the PE's :meth:`~posformer.pe.base.PositionalEncoding.bias_fn`; an ``Offsets`` one too
    under ``BackendPolicy(flex_offsets=False)``), ``"features"`` (a ``Features`` form: the PE's
    ``feature_bias`` of the layer input's per-token features: forget gates), or None (no form: the bias
    reads the call's tensors, or is an MLP over distances at scattered positions)."""
    form = ctx.bias_form
    match form:
        case None:
            return "none"
        case Offsets() if ctx.uses_offset_vector and (ctx.policy.flex_offsets or not form.score_mod):
            return "offsets"
        case Features():
            return "features"
        case Positions(score_mod=True):
            return "elementwise"
    return None


def _bias_trains(ctx: AttentionContext) -> bool:
    """Whether this call trains the PE's bias parameters."""
    return torch.is_grad_enabled() and ctx.has_bias and any(p.requires_grad for p in ctx.pe.parameters())


def _trains_through_flex(ctx: AttentionContext) -> bool:
    """Whether FlexAttention can return this bias's parameter gradients: its ``score_mod`` reads them as
    captured tensors, each indexed once, none 0-d (torch's learned-``score_mod`` support). The offset
    vector is one such tensor for every offset-only bias; an elementwise bias is one when its form states
    ``trainable`` (T5, KERPLE, FIRE); a feature bias reads the features (whose graph reaches the gates)
    as two such tensors."""
    form = bias_form(ctx)
    return form in ("offsets", "features") or form == "elementwise" and ctx.bias_form.trainable


def _needs_grad(q: Tensor, k: Tensor, ctx: AttentionContext) -> bool:
    return (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)) or _bias_trains(ctx)


def wanted(q: Tensor, k: Tensor, ctx: AttentionContext, *, dropout_p: float, device_type: str) -> bool:
    """Whether this call runs on FlexAttention (rule 4 of :func:`posformer.model.backends.choose`).

    Raises :class:`ConfigError` when ``model.attention_backend=flex`` asks for a call it cannot take
    (training on the CPU, or training a bias's parameters); the training flow refuses those settings
    before any work (:mod:`posformer.configs.checks`), so this is reached only from the Python API.
    """
    mode = ctx.attention_backend
    # cannot: the user said sdpa, nothing to compute, no Flex in this torch, a value term, dropout, or
    # a bias that is not one elementwise function of (head, query position, key position)
    if mode == "sdpa" or q.shape[2] == 0 or not available() or ctx.has_value or dropout_p:
        return False
    if bias_form(ctx) is None:
        return False
    # cannot: heads smaller than the device's kernel takes (CUDA: 16)
    if not head_dim_fits(q.shape[-1], device_type):
        if mode == "flex":
            raise ConfigError(small_heads_problem(q.shape[-1]))
        return False
    # cannot: gradients of bias parameters its score_mod does not read as captured tensors (any device),
    # gradients at all on the CPU
    untrainable = _bias_trains(ctx) and not _trains_through_flex(ctx)
    if device_type != "cpu" and untrainable or device_type == "cpu" and _needs_grad(q, k, ctx):
        if mode == "flex":
            raise ConfigError(
                f"model.attention_backend=flex cannot train the parameters of pe={ctx.pe.name}'s bias at "
                "these positions (its score_mod does not read them as captured tensors: its bias form "
                "does not state trainable=True); use model.attention_backend=auto (SDPA with the "
                "materialised bias) or freeze the PE."
                if device_type != "cpu"
                else "model.attention_backend=flex needs a CUDA device for gradients (FlexAttention has no "
                "CPU backward); use model.attention_backend=auto (or sdpa) to train on the CPU."
            )
        return False
    # asked for: wherever it can run
    if mode == "flex":
        return device_type in ("cpu", "cuda")
    # auto, CUDA: a bias or packed documents (block sparsity), but not a one-query decoding step (a
    # one-row mask beats a block mask per step); a bias-free padded call stays on SDPA's boolean-mask
    # kernel, which compiles nothing
    if device_type == "cuda":
        return q.shape[2] > 1 and (ctx.has_bias or ctx.segment_ids is not None)
    # auto, CPU: inference of a non-offset elementwise bias (FIRE) over many keys, where the compiled
    # kernel beats the materialised mask (scripts/bench_flex_cpu.py) — if this machine compiles it
    form = ctx.bias_form
    return (
        device_type == "cpu"
        and form is not None
        and form.score_mod
        and not isinstance(form, Offsets)
        and k.shape[2] >= CPU_MIN_KEYS
        and ctx.policy.flex_compiled
        and cpu_compiles()
    )


def small_heads_problem(head_dim: int) -> str:
    """The one line for forced FlexAttention on CUDA with heads of ``head_dim`` < 16."""
    return (
        f"model.attention_backend=flex needs heads of at least {CUDA_MIN_HEAD_DIM} dimensions on CUDA "
        f"(Triton's kernel), but d_model/n_heads = {head_dim}; use model.attention_backend=auto (SDPA for "
        f"those calls) or fewer heads (model.n_heads <= d_model/{CUDA_MIN_HEAD_DIM})."
    )


@functools.cache
def kernel(device_type: str, compiled: bool) -> Callable[..., Tensor]:
    """``flex_attention``, compiled once per device type (see the module docstring), or eager."""
    if not compiled:
        return flex_attention
    return torch.compile(flex_attention, dynamic=device_type == "cuda")


def reset_compiled() -> None:
    """Forget every compiled graph and cached block mask: a new run or evaluation subject starts with
    its own :data:`RECOMPILE_LIMIT` (the jobs of a multirun, and the checkpoints of one
    ``posformer-eval``, share one process; each model's PE compiles graphs of its own)."""
    torch._dynamo.reset()
    causal_block_mask.cache_clear()
    span_block_mask.cache_clear()


def divisible(q: Tensor, k: Tensor, policy: BackendPolicy | None) -> bool:
    """Whether to tell the kernel that ``q`` (B, H, Tq, Dh) and ``k`` (B, H, Tk, Dh) have lengths that
    are multiples of :data:`DIVISIBLE_BY`: on CUDA (where it is compiled with dynamic shapes, so it
    cannot know), under ``policy.flex_divisible`` (default), when they are."""
    hint = policy is None or policy.flex_divisible
    return hint and q.device.type == "cuda" and q.shape[2] % DIVISIBLE_BY == 0 == k.shape[2] % DIVISIBLE_BY


def call_kernel(
    fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, *, is_divisible: bool = False, **kwargs: Any
) -> Tensor:
    """``fn(q, k, v, **kwargs)`` with at most :data:`RECOMPILE_LIMIT` graphs, never a silent eager fallback.

    ``is_divisible`` (:func:`divisible`): the compiled kernel gets ``IS_DIVISIBLE``, a second graph next to
    the general one (two per call kind, whatever the lengths). Inside an enclosing ``torch.compile`` (a
    compiled model) the plain ``flex_attention`` is traced, and inductor sees the lengths itself.
    """
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kwargs)
    if is_divisible and fn is not flex_attention:
        kwargs["kernel_options"] = {"IS_DIVISIBLE": True}
    what = f"batch {q.shape[0]}, {q.shape[2]} queries x {k.shape[2]} keys, {q.dtype}"
    return _within_budget(fn, what, q, k, v, **kwargs)


def _within_budget(fn: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` allowed at most :data:`RECOMPILE_LIMIT` graphs (``what``: the call, for the
    message), its backward lowered at once (a compile failure of the backward arrives here, at the
    forward: :func:`is_compile_failure`)."""
    import torch._functorch.config as aot_config  # loaded with dynamo; here, not at posformer's import
    import torch.fx.experimental._config as shape_config

    limits = {"recompile_limit": RECOMPILE_LIMIT, "fail_on_recompile_limit_hit": True}
    eager = "force_non_lazy_backward_lowering"  # torch >= 2.6; older: the backward lowers at its first call
    eager_backward = {eager: True} if hasattr(aot_config, eager) else {}
    # sizes that happen to be equal (a key's storage offset d_model and a batch of d_model rows) keep
    # their own symbols, so the next batch size does not recompile
    no_duck = {"use_duck_shape": False} if hasattr(shape_config, "use_duck_shape") else {}
    try:
        with (
            torch._dynamo.config.patch(**limits),
            aot_config.patch(**eager_backward),
            shape_config.patch(**no_duck),
        ):
            return fn(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise FlexRecompileError(
            f"FlexAttention compiled more than {RECOMPILE_LIMIT} graphs in this process (a new graph per "
            f"call kind, shape or dtype: {what}); torch would fall back to an eager kernel that "
            "materialises every score. Use model.attention_backend=sdpa, or report the call pattern "
            "(docs/performance.md)."
        ) from None


#: the modules whose exceptions are compile failures (dynamo, inductor, Triton)
_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "triton")


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause or context) is FlexAttention's compiler failing rather than the
    computation: the graph limit (:class:`FlexRecompileError`), dynamo, inductor or Triton refusing or
    failing to build a kernel, a kernel needing more shared memory than the GPU has. Out of memory is
    not one (the run's own handler names the fix)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None or is_out_of_memory(seen):
            return False
        module = type(seen).__module__ or ""
        if isinstance(seen, FlexRecompileError) or module.startswith(_COMPILER_MODULES):
            return True
        if is_kernel_out_of_resources(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def block_mask(ctx: AttentionContext, tq: int, tk: int, batch: int, device: torch.device) -> Any:
    """The ``BlockMask`` of the context's visibility for ``tq`` queries over ``tk`` keys, or None.

    A purely causal mask depends on the lengths alone, a sliding window's on the lengths, the window and
    the first key's index: each is built once per process (:func:`causal_block_mask`,
    :func:`span_block_mask`) and shared by every forward; masks that read padding, documents or chunks
    of positions are built once per context (shared by its layers).
    """
    visible = ctx.visible_fn()
    if visible is None:
        return None
    if not ctx.visibility_per_row and ctx.span.full and ctx.causal:
        return causal_block_mask(tq, tk, device)
    if not ctx.visibility_per_row and ctx.span.kind == "sliding":
        return span_block_mask(tq, tk, ctx.causal, ctx.span, ctx.key_start, device)

    def build() -> Any:
        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return visible(b, q_idx, kv_idx)

        rows = batch if ctx.visibility_per_row else None
        return build_block_mask(mask_mod, rows, tq, tk, device)

    return ctx.cached_block_mask(tq, tk, device, build)


@functools.lru_cache(maxsize=64)
def causal_block_mask(tq: int, tk: int, device: torch.device) -> Any:
    """Causal ``BlockMask`` of ``tq`` queries over ``tk`` keys: query ``i`` sees keys ``<= tk - tq + i``."""
    offset = tk - tq

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return build_block_mask(causal, None, tq, tk, device)


@functools.lru_cache(maxsize=64)
def span_block_mask(tq: int, tk: int, causal: bool, span: Span, key_start: int, device: torch.device) -> Any:
    """``BlockMask`` of a sliding window (``span``) over ``tq`` queries and ``tk`` keys, the first of which
    is key ``key_start`` of the sequence (a rolling cache dropped the others), causal or not: it depends
    on these alone, so it is built once per process for them and shared by every forward."""
    offset = tk - tq

    def windowed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        near = span.visible(q_idx + (offset + key_start), kv_idx + key_start, causal)
        return near & (kv_idx <= q_idx + offset) if causal else near

    return build_block_mask(windowed, None, tq, tk, device)


def build_block_mask(
    mask_mod: Callable[..., Tensor], rows: int | None, tq: int, tk: int, device: torch.device
) -> Any:
    """``create_block_mask(mask_mod, rows, None, tq, tk)``: compiled on CUDA, within posformer's graph
    budget (:data:`RECOMPILE_LIMIT`, as the kernel's) instead of torch's default of 8 graphs, whose
    overrun would build masks eagerly with a recompile-limit warning; eager on the CPU (nothing to
    compile for a mask of short lengths)."""
    with torch.no_grad():  # a mask has no gradient: one graph serves training and evaluation
        if device.type != "cuda":
            return create_block_mask(mask_mod, rows, None, tq, tk, device=device)
        what = f"a block mask of batch {rows or 1}, {tq} queries x {tk} keys"
        return _within_budget(_compiled_block_mask(), what, mask_mod, rows, None, tq, tk, device=device)


@functools.cache
def _compiled_block_mask() -> Callable[..., Any]:
    """``torch.compile(create_block_mask)``, once per process (torch's own advice for its ``_compile``)."""
    return torch.compile(create_block_mask)


def score_mod(ctx: AttentionContext, layer: int, batch: int) -> Callable[..., Tensor]:
    """Layer ``layer``'s bias as a ``score_mod`` (:func:`bias_form`).

    ``offsets``: ``score + vec[h, Tq - 1 - q_idx + kv_idx]`` with ``vec`` the context's float32 offset
    vector (built once per forward and bias layer, shared with the offset backend; ``-inf`` only where
    the block mask hides the key anyway): one captured tensor, indexed once, so its gradient flows to
    the PE's parameters through ``vec``'s own graph; nothing but an index per score. ``elementwise``:
    ``score + bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])`` from the PE's ``bias_fn``. ``features``:
    :func:`_feature_score_mod`.
    """
    if bias_form(ctx) == "offsets":
        # (1, H, Tq + Tk - 1), captured whole and never as a view: under dynamo a captured view's
        # gradient is dropped (torch 2.13, seen with aot_eager: tests/model/test_flex_learned.py), and the
        # bidirectional vector is one (a slice of the PE's bias); the copy is H·(Tq + Tk - 1) floats
        vec = ctx.offset_vector(layer, torch.float32)
        if vec._base is not None:
            vec = vec.clone()
        last = ctx.q_pos.shape[1] - 1  # entry m = Tq - 1 - i + j

        def from_offsets(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + vec[0, h, kv_idx - q_idx + last].to(score.dtype)

        return from_offsets
    if bias_form(ctx) == "features":
        return _feature_score_mod(ctx, layer)
    bias_at = ctx.pe.bias_fn(layer)
    q_pos, k_pos = ctx.q_pos, ctx.k_pos
    if q_pos.shape[0] != batch:
        q_pos = q_pos.expand(batch, -1).contiguous()  # (B, Tq)
    if k_pos.shape[0] != batch:
        k_pos = k_pos.expand(batch, -1).contiguous()  # (B, Tk)

    def biased(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx]).to(score.dtype)

    return biased


def _feature_score_mod(ctx: AttentionContext, layer: int) -> Callable[..., Tensor]:
    """``score + feature_bias(qf[b, h, q_idx], kf[b, h, kv_idx])`` from the layer's scalar input features.

    ``qf`` (B, H, Tq) and ``kf`` (B, H, Tk) are fresh float32 copies, two distinct tensors even when the
    query and key features are one (no KV cache): each captured tensor is read by one index and none is
    a view, so FlexAttention returns their gradients (and through their graph, the gates')."""
    q_feats, k_feats = ctx.features(layer)  # (B, H, Tq, 1), (B, H, Tk, 1)
    qf = q_feats[..., 0].float().clone()  # (B, H, Tq)
    kf = k_feats[..., 0].float().clone()  # (B, H, Tk)
    fn = ctx.pe.feature_bias

    def from_features(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + fn(qf[b, h, q_idx], kf[b, h, kv_idx]).to(score.dtype)

    return from_features


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    batch, tq, tk = q.shape[0], q.shape[2], k.shape[2]
    mask = block_mask(ctx, tq, tk, batch, q.device)
    mod = score_mod(ctx, layer, batch) if ctx.has_bias else None
    fn = kernel(q.device.type, ctx.policy.flex_compiled)
    sinks = ctx.sink_logits(layer)  # (H,) | None: the LSE correction (backends/sinks.py)
    hint = divisible(q, k, ctx.policy)
    if sinks is None:
        return call_kernel(fn, q, k, v, score_mod=mod, block_mask=mask, is_divisible=hint)
    out, lse = call_kernel(fn, q, k, v, score_mod=mod, block_mask=mask, return_lse=True, is_divisible=hint)
    return rescale_by_sinks(out, lse, sinks)


def causal_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: KeyVisible | None = None,
    tag: str = "",
    *,
    compiled: bool = True,
    ctx: AttentionContext | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of ``q`` over ``k``, ``v`` (B, H, T, Dh) each, scale ``Dh**-0.5``, with its
    log-sum-exp: ((B, H, T, Dh), (B, H, T) float32, natural log: FlexAttention's kernels work in base 2
    and its public function converts, checked against ``torch.logsumexp`` in
    ``tests/pe/test_shaw_flex_shortcut.py``). The :class:`~posformer.pe.base.CausalLSE` of CUDA (Shaw's
    region shortcut); ``compiled=False``: the eager kernel (it materialises the scores: tests only).
    ``visible`` (padding, documents) joins causality in a block mask of the batch's rows, built once
    per ``ctx`` and ``tag``; Flex gives a query that sees no key output 0 and log-sum-exp ``-inf``."""
    fn = kernel(q.device.type, compiled)
    tq, tk, device = q.shape[2], k.shape[2], q.device
    if visible is None:
        mask = causal_block_mask(tq, tk, device)  # built once per length and device
    else:
        offset = tk - tq

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx + offset) & visible(b, q_idx, kv_idx)

        def build() -> Any:
            return build_block_mask(mask_mod, q.shape[0], tq, tk, device)

        mask = build() if ctx is None else ctx.cached_block_mask(tq, tk, device, build, tag)
    hint = divisible(q, k, ctx.policy if ctx is not None else None)
    out, lse = call_kernel(fn, q, k, v, block_mask=mask, return_lse=True, is_divisible=hint)
    return out, lse.float()

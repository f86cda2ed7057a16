"""FlexAttention traced as on CUDA, with inductor's own checks of its backward graph.

``torch.compile(flex_attention, backend="aot_eager", dynamic=True)`` traces Flex through dynamo and AOT
autograd as a GPU run does and runs the traced joint graph with eager kernels; what it leaves to the GPU
is inductor's lowering. Part of that lowering refuses a graph before it generates any code:
``validate_joint_graph`` (torch's ``_inductor/kernel/flex/flex_attention.py``) rejects a ``score_mod``
that indexes one trainable captured tensor more than once, whose gradient scatters would have to add
up ("Using multiple indexing operations on the same tensor that requires gradients in a score_mod
function is not currently supported"). :func:`compiled_flex` runs that check on every Flex backward
it traces, so a CPU test fails where the first GPU training step would.

:func:`as_on_cuda` goes one step further for a whole model: the attention decisions are CUDA's, Flex
is traced through :func:`checked_backend` wherever it runs, and two CPU-only refusals of torch are
lifted (see its docstring), so a compiled model takes the GPU's paths with CPU tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def compiled_flex() -> tuple[Callable[..., Any], list[str]]:
    """``flex_attention`` compiled with dynamic shapes through :func:`checked_backend`, and the list that
    gets the name of each graph checked (so a test can assert the check ran: the backward is traced at
    the first ``backward()``)."""
    from torch.nn.attention.flex_attention import flex_attention

    backend, checked = checked_backend()
    return torch.compile(flex_attention, backend=backend, dynamic=True), checked


def gpu_input_checks(gm: torch.fx.GraphModule) -> None:
    """The checks inductor's GPU lowering makes of every Flex call's inputs in a traced graph before it
    generates code (its CPU template makes neither): heads of at least 16 dimensions (Triton's
    ``tl.dot``), and in the backward one dtype for q, k and v."""
    flex_calls = (torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward)
    for node in (n for n in gm.graph.nodes if n.op == "call_function" and n.target in flex_calls):
        q, k, v = (arg.meta["val"] for arg in node.args[:3])  # (B, H, T, Dh) fake tensors
        if q.shape[-1] < 16 or v.shape[-1] < 16:
            raise NotImplementedError(
                "NYI: embedding dimension of the query, key, and value must be at least 16 but got "
                f"E={q.shape[-1]} and Ev={v.shape[-1]} (inductor's GPU kernel)"
            )
        if node.target is flex_calls[1] and not q.dtype == k.dtype == v.dtype:
            raise ValueError(
                f"Backward pass with mixed query, key, and value dtype: {q.dtype}, {k.dtype}, {v.dtype}"
            )


def checked_backend() -> tuple[Any, list[str]]:
    """A ``torch.compile`` backend: AOT autograd with the eager kernels (``aot_eager``), inductor's GPU
    input checks on every traced graph (:func:`gpu_input_checks`) and its joint-graph check on every
    Flex backward; and the list of the backward graphs checked."""
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    checked: list[str] = []

    def forward(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        gpu_input_checks(gm)
        return make_boxed_func(gm.forward)

    def backward(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        gpu_input_checks(gm)
        flex_backward = torch.ops.higher_order.flex_attention_backward
        for node in (n for n in gm.graph.nodes if n.op == "call_function" and n.target is flex_backward):
            # its forward and joint score_mod graphs are get_attr submodules among the arguments
            for arg in (a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"):
                sub = getattr(gm, arg.target)
                if isinstance(sub, torch.fx.GraphModule):
                    graph = copy.deepcopy(sub.graph)  # as inductor does, on a copy the run never sees
                    graph.eliminate_dead_code()
                    validate_joint_graph(graph)
                    checked.append(str(arg.target))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward), checked


def as_on_cuda(monkeypatch: Any) -> list[str]:
    """Make this test's models take CUDA's attention paths with CPU tensors; returns the list of the Flex
    graphs checked (:func:`checked_backend`).

    - The decision (:func:`posformer.model.backends.choose`) is asked for ``device_type="cuda"``, and the
      shortcuts get CUDA's causal log-sum-exp kernel (Flex).
    - Flex outside a compiled model (``flex.kernel``) is traced through :func:`checked_backend` with
      dynamic shapes, as ``torch.compile(flex_attention, dynamic=True)`` is on CUDA.
    - torch refuses Flex gradients for CPU tensors up front (``_validate_device``: inductor has no CPU
      backward template); the traced graphs run with the eager kernels, which are device-free.
    - torch's eager Flex backward (``sdpa_dense_backward``) returns no gradient for a captured tensor
      that does not require one when it runs. In a compiled backward every saved tensor arrives
      detached, so a learned bias built inside the compiled model would lose its gradient (the run
      fails adding it up). Inductor decides from the traced joint graph which captured tensors get
      gradients; the stand-in below does the same, then runs torch's own backward.
    """
    import torch.nn.attention.flex_attention as flex_module
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention_backward, sdpa_dense_backward

    from posformer.model import attention
    from posformer.model.backends import flex, shortcut

    choose, lse_kernel = attention.choose, shortcut.causal_lse_kernel
    backend, checked = checked_backend()
    kernel = torch.compile(flex_module.flex_attention, backend=backend, dynamic=True)

    def choose_as_cuda(q: Any, k: Any, ctx: Any, *, dropout_p: float, device_type: str) -> str:
        return choose(q, k, ctx, dropout_p=dropout_p, device_type="cuda")

    def dense_backward(*args: Any) -> Any:
        # (q, k, v, out, lse, grad_out, grad_lse, fw_graph, joint_graph, block_mask, scale, kernel
        # options, score_mod buffers, mask_mod buffers); the joint graph returns (score, b, h, m, n,
        # *buffers)'s gradients
        args = list(args)
        (outputs,) = [n.args[0] for n in args[8].graph.nodes if n.op == "output"]
        wanted = [grad is not None for grad in outputs[5:]]
        args[-2] = tuple(b.detach().requires_grad_() if w else b for b, w in zip(args[-2], wanted))
        return sdpa_dense_backward(*args)

    monkeypatch.setattr(attention, "choose", choose_as_cuda)
    monkeypatch.setattr(shortcut, "causal_lse_kernel", lambda device_type, *a: lse_kernel("cuda", *a))
    monkeypatch.setattr(flex, "kernel", lambda device_type, compiled: kernel)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    monkeypatch.setitem(
        flex_attention_backward.py_kernels, DispatchKey.CompositeExplicitAutograd, dense_backward
    )
    monkeypatch.setattr(flex_attention_backward, "_dispatch_cache", {})  # it caches the kernel per key
    return checked


def record_choices(monkeypatch: Any) -> list[str]:
    """The list that gets the name of every attention backend chosen from now on (after
    :func:`as_on_cuda`: CUDA's choices), in call order."""
    from posformer.model import attention

    used: list[str] = []
    choose = attention.choose

    def recorded(*args: Any, **kwargs: Any) -> str:
        used.append(choose(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(attention, "choose", recorded)
    return used


def record_lse_calls(monkeypatch: Any) -> list[str]:
    """The list that gets an entry each time a PE's shortcut calls the causal log-sum-exp kernel it was
    handed (after :func:`as_on_cuda`: CUDA's, Flex). A shortcut chosen does not mean Flex ran: CoPE's
    training function never calls it."""
    from posformer.model.backends import shortcut

    calls: list[str] = []
    kernel_for = shortcut.causal_lse_kernel

    def recorded(*args: Any, **kwargs: Any) -> Any:
        kernel = kernel_for(*args, **kwargs)
        if kernel is None:
            return None

        def counted(*a: Any, **kw: Any) -> Any:
            calls.append("causal_lse")
            return kernel(*a, **kw)

        return counted

    monkeypatch.setattr(shortcut, "causal_lse_kernel", recorded)
    return calls

"""FlexAttention traced as on CUDA, with inductor's own checks of its backward graph.

``torch.compile(flex_attention, backend="aot_eager", dynamic=True)`` traces Flex through dynamo and AOT
autograd as a GPU run does and runs the traced joint graph with eager kernels; what it leaves to the GPU
is inductor's lowering. Part of that lowering refuses a graph before it generates any code:
``validate_joint_graph`` (torch's ``_inductor/kernel/flex/flex_attention.py``) rejects a ``score_mod``
that indexes one trainable captured tensor more than once, whose gradient scatters would have to add
up ("Using multiple indexing operations on the same tensor that requires gradients in a score_mod
function is not currently supported"). :func:`compiled_flex` runs that check on every Flex backward
it traces, so a CPU test fails where the first GPU training step would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def compiled_flex() -> tuple[Callable[..., Any], list[str]]:
    """``flex_attention`` compiled with dynamic shapes through AOT autograd, inductor's joint-graph check
    run on each traced backward; and the list that gets the name of each graph checked (so a test can
    assert the check ran: the backward is traced at the first ``backward()``)."""
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph
    from torch.nn.attention.flex_attention import flex_attention

    checked: list[str] = []

    def forward(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def backward(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
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

    backend = aot_autograd(fw_compiler=forward, bw_compiler=backward)
    return torch.compile(flex_attention, backend=backend, dynamic=True), checked

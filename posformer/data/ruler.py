"""RULER-style retrieval and tracking tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?"), small enough to train from scratch: ``data=ruler_multikey``,
``data=ruler_multivalue``, ``data=ruler_vartrack``.

Like ``passkey`` (:mod:`posformer.data.synthetic`), the instance length ``n`` is the number of filler
tokens (the haystack); ``m = needles`` (default 4) items are hidden in it at uniformly random places
(in order where order matters), then a query follows. ``k`` = ``key_len`` digits make a value, keys and
variables come from an alphabet of ``symbols`` names.

================  ===================================================  ==================================
task              prompt                                               answer
================  ===================================================  ==================================
``multikey``      ``m`` needles ``<key> K d1..dk`` with distinct keys   the ``k`` digits of key ``Q``
                  ``K``, then ``<query> Q`` (``Q`` one of them)
``multivalue``    ``m`` needles ``<key> K d1..dk`` with the *same* key  the ``m`` values, in the order they
                  and different values, then ``<query> K``              appear (``m·k`` digits)
``vartrack``      two chains ``x1 = d1..dk``, ``x2 = x1``, …,           the chain's ``m`` variables, in
                  ``xm = x(m-1)`` (distinct variables, each chain in    order
                  order, the two interleaved), then ``<query> d1..dk``
                  naming one chain's value
================  ===================================================  ==================================

Token ids after the 4 specials: digits ``0-9``, ``<key>``, ``<query>``, ``=``, the 5 fillers, the
``symbols`` names. The generators share the synthetic tasks' signature ``(rng, n, options) -> (prompt,
answer)`` and are registered in :data:`posformer.data.synthetic.TASKS`, so data splits, caching,
collation, training and the extrapolation harness treat them as any other task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from posformer.data.tokenizers import SPECIAL_TOKENS

N_SPECIAL = len(SPECIAL_TOKENS)  # PAD, BOS, EOS, SEP
N_FILLER = 5
DIGIT0 = N_SPECIAL
KEY, QUERY, EQUALS = N_SPECIAL + 10, N_SPECIAL + 11, N_SPECIAL + 12
FILLER0 = N_SPECIAL + 13
NAME0 = FILLER0 + N_FILLER


def vocab(options: dict[str, Any]) -> list[str]:
    """Token names after the specials (index + 4 = id)."""
    digits = [str(d) for d in range(10)]
    return [*digits, "<key>", "<query>", "=", *(f"f{i}" for i in range(N_FILLER))] + [
        f"x{i}" for i in range(options["symbols"])
    ]


def _digits(rng: np.random.Generator, k: int) -> list[int]:
    return (rng.integers(0, 10, k) + DIGIT0).tolist()


def _hide(rng: np.random.Generator, n: int, items: list[list[int]]) -> list[int]:
    """``n`` filler tokens with ``items`` inserted, in their order, at uniformly random places."""
    filler = [FILLER0 + (i % N_FILLER) for i in range(n)]
    cuts = np.sort(rng.integers(0, n + 1, len(items))).tolist()
    out, prev = [], 0
    for cut, item in zip(cuts, items):
        out += filler[prev:cut] + item
        prev = cut
    return out + filler[prev:]


def _multikey(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    m, k = o["needles"], o["key_len"]
    keys = (rng.choice(o["symbols"], size=m, replace=False) + NAME0).tolist()
    values = [_digits(rng, k) for _ in range(m)]
    q = int(rng.integers(0, m))
    prompt = _hide(rng, n, [[KEY, key, *v] for key, v in zip(keys, values)])
    return prompt + [QUERY, keys[q]], values[q]


def _multivalue(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    m, k = o["needles"], o["key_len"]
    key = int(rng.integers(0, o["symbols"])) + NAME0
    values = [_digits(rng, k) for _ in range(m)]
    prompt = _hide(rng, n, [[KEY, key, *v] for v in values])
    return prompt + [QUERY, key], [d for v in values for d in v]


def _vartrack(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    m, k = o["needles"], o["key_len"]
    names = (rng.choice(o["symbols"], size=2 * m, replace=False) + NAME0).tolist()
    chains = [names[:m], names[m:]]
    values = [_digits(rng, k), _digits(rng, k)]
    while values[1] == values[0]:
        values[1] = _digits(rng, k)
    steps = [  # per chain: x1 = value, then x_i = x_(i-1)
        [[c[0], EQUALS, *v]] + [[c[i], EQUALS, c[i - 1]] for i in range(1, m)] for c, v in zip(chains, values)
    ]
    order = rng.permutation([0] * m + [1] * m).tolist()  # interleave the chains, each kept in order
    nxt = [0, 0]
    items = []
    for which in order:
        items.append(steps[which][nxt[which]])
        nxt[which] += 1
    q = int(rng.integers(0, 2))
    return _hide(rng, n, items) + [QUERY, *values[q]], chains[q]


TASKS: dict[str, Callable[[np.random.Generator, int, dict[str, Any]], tuple[list[int], list[int]]]] = {
    "multikey": _multikey,
    "multivalue": _multivalue,
    "vartrack": _vartrack,
}
#: the options that change a RULER task's data
PARAMS = ("symbols", "key_len", "needles")


def names_needed(task: str, needles: int) -> int:
    """How many distinct names (``symbols``) a task draws per instance."""
    return {"multikey": needles, "multivalue": 1, "vartrack": 2 * needles}[task]

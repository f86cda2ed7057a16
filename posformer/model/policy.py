"""The backend policy a model hands to every attention context: the user's choice of backend, the
switches that turn backends off (ablations, benchmarks), and the record of a FlexAttention failure under
``auto`` (:func:`posformer.model.backends.choose` reads all three)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: ``ModelConfig.attention_backend`` values: ``auto`` (FlexAttention where it applies and pays: CUDA),
#: ``flex`` (FlexAttention wherever it applies; on the CPU without gradients only), ``sdpa`` (never Flex)
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")


class FlexFallback:
    """Whether FlexAttention failed for a model under ``auto``, and why: a mutable record that the model's
    :class:`BackendPolicy` carries into every context it makes.

    Once :meth:`record` has run, :func:`~posformer.model.backends.choose` never picks FlexAttention (or a
    shortcut that runs on it) for that model again: the remaining calls take SDPA or the materialised
    paths, which compute the same attention more slowly. ``posformer-train`` and ``posformer-eval`` write
    :attr:`reason` into ``results.json`` as ``attention_fallback``.
    """

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    @property
    def active(self) -> bool:
        return self.reason is not None

    def record(self, reason: str) -> bool:
        """Note the first failure; whether this call was the first (the caller warns once)."""
        first = self.reason is None
        if first:
            self.reason = reason
        return first

    def __repr__(self) -> str:
        return f"FlexFallback({self.reason!r})"


@dataclass(frozen=True)
class BackendPolicy:
    """The user's choice and switches for the backend decision (:func:`posformer.model.backends.choose`).

    A model holds one (``model.attention_policy``, from ``ModelConfig.attention_backend``) and hands it
    to every context it makes, so switches travel with the model instead of living in module globals.

    Attributes:
        choice: one of :data:`ATTENTION_BACKENDS` (whether the FlexAttention backend runs).
        off: backends never used (ablations, ``posformer-bench --before``); not the catch-alls.
        flex_compiled: compile FlexAttention (False: its eager form, which materialises the scores:
            quick CPU checks of the Flex path).
        flex_offsets: FlexAttention reads an offset-only bias at contiguous positions from the context's
            offset vector, one captured tensor indexed per score (False: the PE's ``bias_fn`` per
            score, ALiBi's ``slope·(j - i)``, T5's bucket logarithms; ``posformer-bench --before
            flex_offsets`` times one against the other).
        flex_divisible: the dynamic-shape CUDA kernel is told when both lengths are multiples of 128, as
            a static-shape compile knows them (False: it checks every tile's bounds; ``--before
            flex_divisible``).
        fallback: the model's record of a FlexAttention failure under ``auto`` (:class:`FlexFallback`);
            not part of the policy's identity, and kept by ``dataclasses.replace``.
    """

    choice: str = "auto"
    off: frozenset[str] = frozenset()
    flex_compiled: bool = True
    flex_offsets: bool = True
    flex_divisible: bool = True
    fallback: FlexFallback = field(default_factory=FlexFallback, compare=False, repr=False)

    @property
    def flex_usable(self) -> bool:
        """Whether FlexAttention may run: not switched off, and it has not failed under ``auto``."""
        return "flex" not in self.off and not self.fallback.active

"""``posformer-needle``: the passkey depth × length grid of a checkpoint trained on ``data=passkey``.

    posformer-needle <ckpt> --lengths 32 64 128 256 --depths 0 0.25 0.5 0.75 1 --n 32 --out needle/

writes ``needle.{json,csv,md}`` and the heat map ``needle.{png,svg}`` into ``--out``
(:mod:`posformer.eval.needle` does the work). Bad input: one line, status 1, nothing written.
"""

from __future__ import annotations

from collections.abc import Sequence

from posformer.cli.boundary import error_boundary
from posformer.eval import needle

PROG = "posformer-needle"


@error_boundary(PROG)
def main(argv: Sequence[str] | None = None) -> None:
    needle.main(argv, prog=PROG)


if __name__ == "__main__":
    main()

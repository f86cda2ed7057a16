"""``posformer-needle``: the passkey depth × length grid of a checkpoint trained on ``data=passkey``, or,
with ``--mode passkey``, the zero-shot passkey test of any language model run.

    posformer-needle <ckpt> --lengths 32 64 128 256 --bins 10 --n 32 --out needle/
    posformer-needle <lm run>/checkpoints/last.ckpt --mode passkey --lengths 256 512 1024 --out passkey/

write ``needle.{json,csv,md}`` + ``needle.{png,svg}`` (:mod:`posformer.eval.needle`; with the grid mean
beside ``posformer-eval``'s exact match) or ``passkey.*`` (:mod:`posformer.eval.passkey`) into ``--out``.
Bad input: one line, status 1, nothing written.
"""

from __future__ import annotations

from collections.abc import Sequence

from posformer.cli.boundary import error_boundary
from posformer.eval import needle, passkey

PROG = "posformer-needle"


@error_boundary(PROG)
def main(argv: Sequence[str] | None = None) -> None:
    a = needle.parser(PROG).parse_args(argv)
    if a.mode == "passkey":
        passkey.main_passkey(a)
    else:
        needle.run_grid(a)


if __name__ == "__main__":
    main()

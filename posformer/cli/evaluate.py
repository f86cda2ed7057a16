"""``posformer-eval``: evaluate trained checkpoints (Hydra config ``configs/eval.yaml``).

Options of the ``eval`` group:

``eval=extrapolate`` (default)
    Length extrapolation (:mod:`posformer.eval.harness`)::

        posformer-eval eval.checkpoints=[outputs/train/runs/X/checkpoints/last.ckpt] eval.lengths=[128,512]
        posformer-eval eval.sweep_dir=outputs/train/multiruns/X eval.length_multiples=[1,2,4,8,16]
        posformer-eval eval.sweep_dir=... 'eval.rope_scaling={type: yarn, factor: 4}'   # context extension
        posformer-eval ... trainer=gpu                          # same device/precision flags as training

    Results go to the Hydra run dir (or ``eval.output_dir``: reuse it to resume an interrupted sweep).

``eval=translate``
    Translation (BLEU) of an encoder-decoder checkpoint: :func:`posformer.eval.translate.run_translate`.

This module is the command line only: the Hydra entry and the shared error boundary
(:mod:`posformer.cli.boundary`: a :class:`~posformer.errors.PosformerError` or an out-of-memory error
is one ``posformer-eval: error: ...`` line and exit code 2; so is an unknown key at composition,
:mod:`posformer.cli.composition`).
The work is :func:`posformer.eval.run.dispatch`.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from posformer.cli.boundary import ErrorBoundary, precheck_run_dir
from posformer.cli.composition import composition_errors
from posformer.eval.run import dispatch

PROG = "posformer-eval"
EXIT_CODE = 2


def main() -> None:
    """``posformer-eval [overrides]``: precheck the run dir, compose the config, :func:`dispatch`."""
    import hydra

    import posformer.configs  # noqa: F401  (registers the config resolvers, e.g. ${posformer_cwd:})
    from posformer.cli.help import register_help_resolvers

    register_help_resolvers()  # ${posformer_pe_list:} of --help

    with ErrorBoundary(PROG, EXIT_CODE):
        precheck_run_dir(sys.argv[1:])  # Hydra creates the run dir first and would fail with a traceback

    @hydra.main(version_base="1.3", config_path="../configs", config_name="eval")
    def _main(cfg: DictConfig) -> None:
        from posformer.cli.quiet import quiet_console

        quiet_console()
        with ErrorBoundary(PROG, EXIT_CODE):
            dispatch(cfg)

    with composition_errors(sys.argv[1:], PROG, EXIT_CODE):  # an unknown key: one line, exit 2
        _main()


if __name__ == "__main__":
    main()

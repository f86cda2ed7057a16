"""Undo what Hydra itself wrote when a single run fails before posformer writes anything.

Hydra creates the run directory, its ``.hydra/`` record (``config.yaml``, ``hydra.yaml``,
``overrides.yaml``) and the job log *before* any posformer code runs, so a run refused by a check
(a bad value, a resume of a finished run, a checkpoint of another model) would still replace the
``.hydra/`` record of the run directory it was pointed at. :class:`HydraRecord` snapshots that record
before Hydra starts and, when the run fails before posformer wrote its ``config.yaml`` (i.e. before
any work), puts it back byte for byte; a run directory this failed invocation created itself is
removed again. A run that fails later (an interrupted or diverged training) keeps Hydra's record.
Multiruns are left alone: each job records its own failure in ``error.txt``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from posformer.cli.boundary import run_dir_from_argv
from posformer.io import atomic_write_bytes

__all__ = ["HydraRecord"]


class HydraRecord:
    """The ``.hydra/`` files of the run directory named on the command line, as they were at start."""

    def __init__(self, argv: list[str]) -> None:
        self.enabled = not any(a in ("-m", "--multirun") for a in argv)
        found = run_dir_from_argv(argv) if self.enabled else None
        explicit = found is not None and found[0] == "hydra.run.dir"
        self.run_dir: Path | None = found[1].absolute() if explicit else None
        self.existed = self.run_dir is not None and self.run_dir.exists()
        self.files: dict[Path, bytes] = {}
        self.config_stamp = self._config_stamp(self.run_dir)
        if self.existed:
            self.files = {p: p.read_bytes() for p in (self.run_dir / ".hydra").glob("*.yaml") if p.is_file()}

    @staticmethod
    def _config_stamp(run_dir: Path | None) -> tuple[int, int] | None:
        """Identity of posformer's ``config.yaml`` (inode, mtime): an atomic rewrite changes it."""
        path = run_dir / "config.yaml" if run_dir is not None else None
        if path is None or not path.exists():
            return None
        st = path.stat()
        return st.st_ino, st.st_mtime_ns

    def restore_after_failure(self, run_dir: Path | None) -> None:
        """Put the ``.hydra/`` record back, or remove a run dir this run created and left empty of results.

        ``run_dir``: where Hydra actually put the run (``None`` when the task never started).
        """
        if not self.enabled or run_dir is None:
            return
        run_dir = Path(run_dir).absolute()
        if self._config_stamp(run_dir) != (self.config_stamp if run_dir == self.run_dir else None):
            return  # posformer wrote its config.yaml: the run started work, Hydra's record describes it
        if self.existed and run_dir == self.run_dir:
            for path, data in self.files.items():
                if not path.exists() or path.read_bytes() != data:
                    atomic_write_bytes(path, data)
            for path in (run_dir / ".hydra").glob("*.yaml"):
                if path not in self.files:  # written by this failed run only
                    path.unlink(missing_ok=True)
        elif not self.existed and run_dir.is_dir() and not (run_dir / "config.yaml").exists():
            shutil.rmtree(run_dir, ignore_errors=True)

#!/usr/bin/env python
"""``posformer-train`` starting from the *weights* of a checkpoint: a fine-tune in one command.

Unlike ``ckpt_path=`` (which resumes a run: optimizer, schedule, step count and data position), this
starts a fresh run (new optimizer, warmup/schedule and step 0) whose model is initialised from
``init_from``. Typical use, a short fine-tune of a rotary model at 4x its training length with a
context-extension method::

    python scripts/finetune.py init_from=RUN/checkpoints/last.ckpt data=text data.path=... \\
        data.block_size=256 trainer.max_steps=100 schedule.warmup_steps=10 optim.lr=5e-4 \\
        'model.pe_options.scaling={type: yarn, factor: 4, original_max_len: 64}'

Every other argument is a ``posformer-train`` override (``-m`` sweeps work too). The model built from
the config must have the same parameters as the checkpoint (PE options without parameters, such as
the rotary scaling, may differ); a mismatch is an error naming the keys.
"""

from __future__ import annotations

import sys

from posformer.errors import CheckpointError
from posformer.io import safe_load_checkpoint


def _with_init(cls: type, path: str) -> type:
    class Init(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            state = safe_load_checkpoint(path, what="init_from checkpoint").get("state_dict") or {}
            missing, unexpected = self.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise CheckpointError(
                    f"init_from={path!r} does not match the configured model: missing {missing[:5]}, "
                    f"unexpected {unexpected[:5]}. Use the checkpoint's model/pe settings."
                )
            print(f"[finetune] initialised {len(state)} tensors from {path}", flush=True)

    Init.__name__, Init.__qualname__ = cls.__name__, cls.__qualname__
    return Init


def main() -> None:
    init = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(("init_from=", "+init_from="))]
    if len(init) != 1:
        raise SystemExit("usage: python scripts/finetune.py init_from=path/to.ckpt [train overrides]")
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if not a.startswith(("init_from=", "+init_from="))]

    import posformer.lit as lit

    original = lit.module_class
    lit.module_class = lambda kind: _with_init(original(kind), init[0])  # imported per run

    from posformer.cli.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()

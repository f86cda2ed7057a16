"""A layer kind's PE switch during training (``model.layer_kinds.<kind>.switch``, DroPE): the steps after
it use the switched PE, and a run resumed from a checkpoint before or after the switch has the losses and
weights of the unbroken run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from posformer.checkpoints import load_checkpoint
from posformer.lit import LanguageModelModule

STEPS, AT = 6, 3


def _model(switch: dict | None) -> dict:
    kind = {"pe": "rope", **({"switch": switch} if switch else {})}
    return dict(
        kind="decoder",
        vocab_size=11,
        d_model=16,
        n_heads=2,
        n_layers=2,
        pe="rope",
        dropout=0.0,
        layer_kinds={"all": kind},
        layers={"pattern": ["all"]},
    )


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def _loader() -> DataLoader:
    ids = torch.randint(0, 11, (4, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return DataLoader([{"input_ids": ids, "labels": labels}], batch_size=None)  # one step per epoch


def _fit(
    root: Path, switch: dict | None, ckpt: Path | None = None
) -> tuple[dict[int, float], LanguageModelModule]:
    torch.manual_seed(0)
    module = LanguageModelModule(model=_model(switch), optim={"name": "adamw", "lr": 3e-2}, max_steps=STEPS)
    losses = _Losses()
    saver = L.pytorch.callbacks.ModelCheckpoint(root, "{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses, saver],
        default_root_dir=root,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt)
    return losses.losses, module


@pytest.mark.slow  # four tiny Lightning runs (~6 s)
@pytest.mark.parametrize("target", [{"pe": "nope"}, {"pe": "rope", "pe_options": {"proportion": 0.25}}])
def test_resumed_across_the_switch_equals_the_unbroken_run(tmp_path: Path, target: dict) -> None:
    switch = {"at_step": AT, **target}
    full, module = _fit(tmp_path / "full", switch)
    plain, _ = _fit(tmp_path / "plain", None)
    # the same losses up to the switch, different ones after it
    assert [full[s] for s in range(1, AT + 1)] == [plain[s] for s in range(1, AT + 1)]
    assert all(full[s] != plain[s] for s in range(AT + 1, STEPS + 1))
    assert module.model.layer_pes.layer("decoder", module.model.cfg.plan("decoder")[0]) is not None or (
        target["pe"] == "nope"
    )
    for at in (AT - 1, AT + 1):  # a checkpoint saved before the switch, one saved after it
        ckpt = tmp_path / "full" / f"step={at}.ckpt"
        resumed, again = _fit(tmp_path / f"resumed{at}", switch, ckpt)
        assert {s: full[s] for s in resumed} == resumed and max(resumed) == STEPS
        a, b = module.model.state_dict(), again.model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # evaluation loads a checkpoint with the PEs of its step
    ids = torch.randint(0, 11, (1, 9), generator=torch.Generator().manual_seed(2))
    for at in (AT - 1, AT, STEPS):
        loaded = load_checkpoint(tmp_path / "full" / f"step={at}.ckpt").model
        kind = loaded.cfg.plan("decoder")[0]
        pe = loaded.layer_pes.layer("decoder", kind)
        switched = at >= AT
        assert pe is None if target["pe"] == "nope" and switched else pe is not None, at
        if pe is not None:
            assert (pe.rotated_pairs < pe.rotary_dim // 2) == switched, at  # p-RoPE after the switch
        assert torch.isfinite(loaded(ids)).all()

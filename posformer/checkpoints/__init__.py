"""Checkpoints: find them, trust and read them, load them. A floor below ``lit/`` and ``eval/``.

The saved layout (what ``posformer-train`` writes; :class:`posformer.lit.modules.PosformerModule`
saves its constructor arguments with ``save_hyperparameters``):

- ``hyper_parameters.model``: the ``ModelConfig`` fields (vocabulary and pad id filled in from the data);
- ``hyper_parameters.data``: facts about the training data (``task_type``, ``train_length``, the data
  fingerprint, a pretrained tokenizer's identity), the resolved data config (``config``) and the run
  seed (``seed``): enough to rebuild the evaluation data from the checkpoint alone;
- ``state_dict``: the LightningModule's weights, the network's under the ``model.`` prefix;
- ``callbacks``: Lightning's callback states (``ModelCheckpoint``'s ``best_model_path``), ``global_step``.

The training run directory holds the resolved ``config.yaml`` next to ``checkpoints/``: its ``data``
and ``seed`` are the fallback for checkpoints written before the data config was saved in them.

=================  ===========================================================================
``read``           :func:`safe_load_checkpoint` (``weights_only=True``, CRC-checked): the one place a
                   ``.ckpt`` is read; the format and model checks; whether a PE import path is trusted
``find``           a sweep's checkpoints, a run's best or last, the last N of a directory
``load``           the network for evaluation (:func:`load_checkpoint`), a new run's weights
                   (:func:`load_weights`), the data and tokenizer checks
=================  ===========================================================================

Lightning's side (resuming a module, the ``CheckpointIO`` plugin, the callback state's paths) is in
:mod:`posformer.lit.checkpoint`.
"""

from posformer.checkpoints.find import find_checkpoints, last_checkpoints, pick_run_checkpoint, recorded_best
from posformer.checkpoints.load import (
    LoadedCheckpoint,
    check_data_fingerprint,
    check_same_data,
    compile_options,
    data_fingerprint,
    load_checkpoint,
    load_run_config,
    load_weights,
    tokenizer_mismatch,
    train_length,
)
from posformer.checkpoints.read import (
    MODEL_FIELDS_FREE_TO_CHANGE,
    TRUST_FLAG,
    check_checkpoint_format,
    check_checkpoint_matches,
    check_pe_trusted,
    checkpoint_step,
    model_config_differences,
    peek_model_config,
    read_checkpoint,
    safe_load_checkpoint,
    saved_model_config,
)

__all__ = [
    "MODEL_FIELDS_FREE_TO_CHANGE",
    "TRUST_FLAG",
    "LoadedCheckpoint",
    "check_checkpoint_format",
    "check_checkpoint_matches",
    "check_data_fingerprint",
    "check_pe_trusted",
    "check_same_data",
    "checkpoint_step",
    "compile_options",
    "data_fingerprint",
    "find_checkpoints",
    "last_checkpoints",
    "load_checkpoint",
    "load_run_config",
    "load_weights",
    "model_config_differences",
    "peek_model_config",
    "pick_run_checkpoint",
    "read_checkpoint",
    "recorded_best",
    "safe_load_checkpoint",
    "saved_model_config",
    "tokenizer_mismatch",
    "train_length",
]

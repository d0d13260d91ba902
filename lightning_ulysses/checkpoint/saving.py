"""Saving and loading the strategy's checkpoints: a DeepSpeed checkpoint with a completion marker (layout, Hugging
Face models, file digests), and a load after validating it, on the same layout through DeepSpeed or on another number
of ranks or ZeRO stage through :mod:`lightning_ulysses.checkpoint.resharding`. Called by both front ends'
``save_checkpoint`` / ``load_checkpoint`` (the Trainer's and Fabric's strategy) with Lightning's own save and load
(their parents' methods) to wrap: both write DeepSpeed's directory with the tag ``checkpoint``, the Trainer's
checkpoint dict or Fabric's state as DeepSpeed's client state."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ulysses.checkpoint import markers, resharding


def zero_stage(strategy: Any) -> int:
    return int(strategy.config.get("zero_optimization", {}).get("stage", 0))


def save(strategy: Any, checkpoint: dict, filepath: Any, save_with_lightning: Callable[[dict, Any], None],
         module: Any = None, trainer: Any = None) -> None:
    """Lightning's DeepSpeed checkpoint (a directory; every rank writes its shard), marked complete only once every
    rank has written, with the layout and the Hugging Face models of ``module`` recorded (see
    :mod:`lightning_ulysses.checkpoint.markers`). ``trainer``: the Trainer saving, if any (an epoch that ``fit``
    cut short stays open)."""
    filepath = strategy.broadcast(filepath)
    record = {
        "world_size": strategy.world_size, "sp_size": strategy.sp_size, "dp_size": strategy.dp_size,
        "zero_stage": zero_stage(strategy),
        "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
    }
    if strategy.is_global_zero:
        markers.begin_checkpoint(filepath, record)  # before DeepSpeed's barrier: no rank has written yet
    hf_models = markers.hf_model_records(module) if module is not None else {}
    checkpoint = dict(checkpoint)
    if trainer is not None and not trainer.training:  # after fit: an epoch cut short by max_steps stays open
        markers.continue_truncated_epoch(checkpoint, trainer.num_training_batches)
    checkpoint = {**checkpoint, markers.CLIENT_STATE_KEY: {**record, "hf_models": hf_models}}
    save_with_lightning(checkpoint, filepath)  # ends with DeepSpeed's barrier: every rank's files are written
    digests = (markers.hash_files_over_ranks(filepath, strategy.global_rank, strategy.world_size,
                                                 strategy.broadcast)
               if strategy.verify_checkpoints else None)
    if strategy.is_global_zero:
        markers.commit_checkpoint(filepath, record, digests)
    strategy.barrier("ulysses_checkpoint_commit")


def load(strategy: Any, checkpoint_path: Any, load_with_lightning: Callable[[], dict[str, Any]], *, resuming: bool,
         strict: bool) -> dict[str, Any]:
    """Validate a checkpoint directory (incomplete or corrupt checkpoints, other world sizes and, when ``resuming``
    (the optimizer state is loaded too), other ZeRO stages fail here, before DeepSpeed reads anything), then load
    it: through ``load_with_lightning`` on the same layout, re-partitioned on another one. Returns DeepSpeed's
    client state."""
    if os.path.isdir(checkpoint_path):
        stage = zero_stage(strategy)
        marker = markers.validate_for_loading(checkpoint_path, strategy.world_size, stage if resuming else None)
        if marker is not None and strategy.verify_checkpoints:
            markers.verify_digests_over_ranks(checkpoint_path, strategy.global_rank, strategy.world_size)
        saved = (marker or {}).get("world_size"), (marker or {}).get("zero_stage")
        if None not in saved and saved != (strategy.world_size, stage) and min(saved[1], stage) > 0:
            return _load_on_another_layout(strategy, checkpoint_path, marker, resuming, strict)
    with markers.zero3_inference_loading(strategy.deepspeed_engine if strategy.zero_stage_3 else None):
        return load_with_lightning()


def _load_on_another_layout(strategy: Any, checkpoint_path: Any, marker: dict, resuming: bool,
                            strict: bool) -> dict[str, Any]:
    """A ZeRO checkpoint of another number of ranks or ZeRO stage: the weights through DeepSpeed's loader, the
    optimizer state re-partitioned for this run (:mod:`lightning_ulysses.checkpoint.resharding`)."""
    rank_zero_info(
        f"{checkpoint_path} was saved by {marker['world_size']} ranks (dp={marker.get('dp_size')} ×"
        f" sp={marker.get('sp_size')}, ZeRO {marker.get('zero_stage')}); loading it on {strategy.world_size}"
        f" (dp={strategy.dp_size} × sp={strategy.sp_size}, ZeRO {zero_stage(strategy)})"
        + (", the optimizer state re-partitioned ..." if resuming else " ..."))
    started = time.perf_counter()
    engine = strategy.deepspeed_engine
    with markers.zero3_inference_loading(engine if strategy.zero_stage_3 else None):
        client_state = resharding.load_on_another_layout(engine, Path(checkpoint_path), marker, resuming, strict)
    if client_state is None:
        raise ValueError(f"DeepSpeed could not load the model states of {checkpoint_path}.")
    rank_zero_info(f"... loaded in {time.perf_counter() - started:.1f} s.")
    return client_state

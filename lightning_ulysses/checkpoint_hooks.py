"""The strategy's checkpoint hooks: save a DeepSpeed checkpoint with a completion marker (layout, Hugging Face
models, file digests), and load one after validating it, on the same layout through DeepSpeed or on another number of
ranks or ZeRO stage through :mod:`lightning_ulysses.resharding`. Mixed into
:class:`~lightning_ulysses.UlyssesDeepSpeedStrategy` before Lightning's ``DeepSpeedStrategy``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_ulysses import checkpoint as _checkpoint
from lightning_ulysses import resharding


class CheckpointHooks:
    """``save_checkpoint`` / ``load_checkpoint`` of the strategy."""

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's DeepSpeed checkpoint (a directory; every rank writes its shard), marked complete only once every
        rank has written, with the layout and the Hugging Face models recorded (see
        :mod:`lightning_ulysses.checkpoint`)."""
        if storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # raises Lightning's TypeError
        filepath = self.broadcast(filepath)
        assert isinstance(self.config, dict)
        record = {
            "world_size": self.world_size, "sp_size": self.sp_size, "dp_size": self.dp_size,
            "zero_stage": self._zero_stage,
            "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
        }
        if self.is_global_zero:
            _checkpoint.begin_checkpoint(filepath, record)  # before DeepSpeed's barrier: no rank has written yet
        hf_models = _checkpoint.hf_model_records(self.lightning_module) if self.lightning_module is not None else {}
        trainer = getattr(self.lightning_module, "_trainer", None)
        checkpoint = dict(checkpoint)
        if trainer is not None and not trainer.training:  # after fit: an epoch cut short by max_steps stays open
            _checkpoint.continue_truncated_epoch(checkpoint, trainer.num_training_batches)
        checkpoint = {**checkpoint, _checkpoint.CLIENT_STATE_KEY: {**record, "hf_models": hf_models}}
        super().save_checkpoint(checkpoint, filepath)  # ends with DeepSpeed's barrier: every rank's files are written
        digests = (_checkpoint.hash_files_over_ranks(filepath, self.global_rank, self.world_size, self.broadcast)
                   if self.verify_checkpoints else None)
        if self.is_global_zero:
            _checkpoint.commit_checkpoint(filepath, record, digests)
        self.barrier("ulysses_checkpoint_commit")

    @property
    def _zero_stage(self) -> int:
        assert isinstance(self.config, dict)
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if os.path.isdir(checkpoint_path):
            # Incomplete or corrupt checkpoints, other world sizes and (when resuming) other ZeRO stages fail here,
            # before DeepSpeed reads anything.
            trainer = getattr(self.lightning_module, "_trainer", None)
            resuming = trainer is not None and trainer.state.fn == TrainerFn.FITTING
            marker = _checkpoint.validate_for_loading(checkpoint_path, self.world_size,
                                                      self._zero_stage if resuming else None)
            if marker is not None and self.verify_checkpoints:
                _checkpoint.verify_digests_over_ranks(checkpoint_path, self.global_rank, self.world_size)
            saved = (marker or {}).get("world_size"), (marker or {}).get("zero_stage")
            if None not in saved and saved != (self.world_size, self._zero_stage) and min(saved[1], self._zero_stage) > 0:
                return self._load_on_another_layout(checkpoint_path, marker, resuming)
        with _checkpoint.zero3_inference_loading(self.deepspeed_engine if self.zero_stage_3 else None):
            return super().load_checkpoint(checkpoint_path, weights_only)

    def _load_on_another_layout(self, checkpoint_path: Any, marker: dict, resuming: bool) -> dict[str, Any]:
        """A ZeRO checkpoint of another number of ranks or ZeRO stage: the weights through DeepSpeed's loader, the
        optimizer state re-partitioned for this run (:mod:`lightning_ulysses.resharding`)."""
        assert self.lightning_module is not None
        rank_zero_info(
            f"{checkpoint_path} was saved by {marker['world_size']} ranks (dp={marker.get('dp_size')} ×"
            f" sp={marker.get('sp_size')}, ZeRO {marker.get('zero_stage')}); loading it on {self.world_size}"
            f" (dp={self.dp_size} × sp={self.sp_size}, ZeRO {self._zero_stage})"
            + (", the optimizer state re-partitioned ..." if resuming else " ..."))
        started = time.perf_counter()
        with _checkpoint.zero3_inference_loading(self.deepspeed_engine if self.zero_stage_3 else None):
            client_state = resharding.load_on_another_layout(self.deepspeed_engine, Path(checkpoint_path), marker,
                                                             resuming, self.lightning_module.strict_loading)
        if client_state is None:
            raise ValueError(f"DeepSpeed could not load the model states of {checkpoint_path}.")
        rank_zero_info(f"... loaded in {time.perf_counter() - started:.1f} s.")
        return client_state


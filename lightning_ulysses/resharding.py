"""Resume a ZeRO stage 1/2 checkpoint on another number of ranks: the optimizer state re-partitioned.

A ZeRO 1/2 checkpoint holds the whole model once (``mp_rank_00_model_states.pt``) and one optimizer shard per rank
of the ZeRO group (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``): rank ``r``'s contiguous piece of each parameter
group's flat fp32 master weights and of every optimizer state of the same shape (SGD's momentum, Adam's moments),
the last piece padded for alignment. The pieces of all ranks, concatenated without their padding, are the group's
flat tensor, the same whatever the number of ranks; only where it is cut differs.

So on ``N`` new ranks each rank takes the slice ``[start, start + partition)`` of that flat tensor that DeepSpeed's
optimizer of this run owns (its partition size and index come from the engine, so DeepSpeed's own alignment rules
are followed), reading the saved shards **one at a time** and copying only where they overlap its slice: the memory
of one saved shard plus this rank's partition, never the whole optimizer state. Scalars (the step count) and the
parameter groups' hyperparameters (the learning rate the scheduler reached) are the same in every shard. The
module's weights come from DeepSpeed's own loader (``load_optimizer_states=False``).

DeepSpeed's universal checkpoints (``ds_to_universal``) cannot serve here: in 0.19.8 the converter reads
``exp_avg``/``exp_avg_sq`` by name, so SGD with momentum fails, and every parameter is written to its own files
(a second copy of the checkpoint). Its elastic ZeRO 1/2 format loads every shard on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_TAG = "checkpoint"  # the DeepSpeed tag Lightning's DeepSpeedStrategy always uses


def optimizer_shard_files(checkpoint: Path, saved_ranks: int) -> list[Path]:
    """The saved ZeRO 1/2 optimizer shards of a checkpoint directory, by rank of the saving ZeRO group."""
    folder = Path(checkpoint) / _TAG
    files = [folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(saved_ranks)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{checkpoint} lacks the optimizer shards {missing} of its {saved_ranks} saving ranks.")
    return files


def load_resharded_zero12_optimizer(engine: Any, checkpoint: Path, saved_ranks: int) -> None:
    """Fill ``engine``'s ZeRO 1/2 optimizer (this rank's partitions) from the shards ``saved_ranks`` ranks wrote."""
    import torch.distributed as dist

    zero = engine.optimizer  # deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer
    partitions = zero.single_partition_of_fp32_groups  # [group] flat fp32, this rank's (padded) partition
    starts = [dist.get_rank(group=zero.real_dp_process_group[i]) * p.numel() for i, p in enumerate(partitions)]
    states: list[dict[str, Any]] = [{} for _ in partitions]
    offsets = [0] * len(partitions)  # where each saved shard's piece starts in the group's flat tensor
    param_groups = None
    first_shard = None
    for path in optimizer_shard_files(checkpoint, saved_ranks):
        shard = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        if not isinstance(shard["base_optimizer_state"], dict):
            raise ValueError(f"{path} is an elastic ZeRO checkpoint; only the default (rigid) layout is resharded.")
        if param_groups is None:
            param_groups = shard["base_optimizer_state"]["param_groups"]
            first_shard = {k: v for k, v in shard.items() if k not in ("base_optimizer_state",
                                                                       "single_partition_of_fp32_groups")}
        saved_state = shard["base_optimizer_state"]["state"]
        for i, (partition, start) in enumerate(zip(partitions, starts)):
            piece = shard["single_partition_of_fp32_groups"][i]  # [n] without the padding
            n = piece.numel()
            _copy_overlap(piece, offsets[i], partition.data, start)
            for key, value in saved_state.get(i, {}).items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() >= n:  # [n + padding]
                    target = states[i].setdefault(key, torch.zeros_like(partition.data, dtype=value.dtype))
                    _copy_overlap(value[:n], offsets[i], target, start)
                else:  # the same on every shard (e.g. a step count)
                    states[i][key] = value
            offsets[i] += n
        del shard, saved_state
    assert param_groups is not None and first_shard is not None
    zero._load_global_state(first_shard)
    zero.optimizer.load_state_dict({"state": {i: s for i, s in enumerate(states) if s},
                                    "param_groups": param_groups})
    zero._link_all_hp_params()
    for group, (partition, start) in enumerate(zip(partitions, starts)):  # the model's weights from the masters
        _write_back(zero, group, partition)


def _copy_overlap(piece: torch.Tensor, piece_start: int, target: torch.Tensor, target_start: int) -> None:
    """Copy the part of ``piece`` (at ``piece_start`` of the flat tensor) that falls into ``target`` (at
    ``target_start``)."""
    lo = max(piece_start, target_start)
    hi = min(piece_start + piece.numel(), target_start + target.numel())
    if lo < hi:
        target[lo - target_start:hi - target_start].copy_(piece[lo - piece_start:hi - piece_start])


def _write_back(zero: Any, group: int, partition: torch.Tensor) -> None:
    """This rank's bit16 (here: model-precision) partition from its fp32 master partition, then every rank's
    partitions gathered into the model's parameters (DeepSpeed's own all-gather after a step)."""
    import torch.distributed as dist

    partition_id = dist.get_rank(group=zero.real_dp_process_group[group])
    zero.parallel_partitioned_bit16_groups[group][partition_id].data.copy_(partition.data)

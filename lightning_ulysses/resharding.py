"""Resume a ZeRO checkpoint on another number of ranks: the optimizer state re-partitioned at load.

**ZeRO 1/2.** The checkpoint holds the whole model once (``mp_rank_00_model_states.pt``) and one optimizer shard per
rank of the ZeRO group (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``): rank ``r``'s contiguous piece of each
parameter group's flat fp32 master weights and of every optimizer state of the same shape (SGD's momentum, Adam's
moments), the last piece padded for alignment. The pieces of all ranks, concatenated without their padding, are the
group's flat tensor, the same whatever the number of ranks; only where it is cut differs. So on ``N`` new ranks each
rank takes the slice ``[start, start + partition)`` of that flat tensor that DeepSpeed's optimizer of this run owns
(its partition size and index come from the engine, so DeepSpeed's own alignment rules are followed).

**ZeRO 3.** Every parameter is cut separately: rank ``r`` holds elements ``[r·c, (r+1)·c)`` of each parameter
(``c = ceil(numel / ranks)``, the last chunk padded), and its flat fp32 groups are those chunks one parameter after
the other, in the model's order; the optimizer states have the same layout. Each new rank assembles its chunk of
every parameter from the saved chunks that overlap it. The weights follow from the fp32 masters.

Either way the saved shards are opened **memory-mapped, one at a time**, and only the parts that overlap this rank's
partition are read: the memory of this rank's partition plus what it copies, never the whole optimizer state. Scalars
(step counts) and the parameter groups' hyperparameters (the learning rate the scheduler reached) are the same in
every shard. No converted copy is written, so a crash during loading leaves nothing half-converted behind.

DeepSpeed's universal checkpoints (``ds_to_universal``) cannot serve here: in 0.19.8 the converter reads
``exp_avg``/``exp_avg_sq`` by name, so SGD with momentum fails, and every parameter is written to its own files
(a second copy of the checkpoint). Its elastic ZeRO 1/2 format loads every shard on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

_TAG = "checkpoint"  # the DeepSpeed tag Lightning's DeepSpeedStrategy always uses


def optimizer_shard_files(checkpoint: Path, saved_ranks: int) -> list[Path]:
    """The saved ZeRO optimizer shards of a checkpoint directory, by rank of the saving ZeRO group (``bf16_`` first:
    DeepSpeed's name when training in bf16)."""
    folder = Path(checkpoint) / _TAG
    files = []
    for r in range(saved_ranks):
        names = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for prefix in ("bf16_", "")]
        found = [folder / name for name in names if (folder / name).is_file()]
        if not found:
            raise ValueError(f"{checkpoint} lacks the optimizer shard of rank {r} of its {saved_ranks} saving ranks.")
        files.append(found[0])
    return files


@contextmanager
def model_states_of_a_saved_rank(engine: Any, saved_ranks: int) -> Iterator[None]:
    """ZeRO 3 writes one model-states file per rank (the client state, the same on every rank, with placeholders for
    the partitioned weights) and DeepSpeed's loader opens the one of its own rank: ranks beyond the saved ones open
    rank ``rank % saved_ranks``'s instead. No change at ZeRO 0-2 (one ``mp_rank_00`` file)."""
    if not engine.zero_optimization_partition_weights():
        yield
        return
    import torch.distributed as dist

    own = dist.get_rank(group=engine.optimizer.dp_process_group)
    original = engine._get_ckpt_name

    def saved_rank_name(path: Any, tag: Any, mp_placeholder: Any = None, pp_placeholder: Any = None) -> str:
        return original(path, tag, mp_placeholder, str(own % saved_ranks) if pp_placeholder is None else pp_placeholder)

    engine._get_ckpt_name = saved_rank_name
    try:
        yield
    finally:
        del engine._get_ckpt_name


def _open_shard(path: Path) -> dict[str, Any]:
    """A saved shard's ``optimizer_state_dict``, its tensors memory-mapped (read from disk only where sliced)."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]


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
        shard = _open_shard(path)
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


def load_resharded_zero3_optimizer(engine: Any, checkpoint: Path, saved_ranks: int) -> None:
    """Fill ``engine``'s ZeRO 3 optimizer (fp32 masters, optimizer states, and from them the weights' partitions)
    from the shards ``saved_ranks`` ranks wrote."""
    import math

    import torch.distributed as dist

    zero = engine.optimizer  # deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3
    rank = dist.get_rank(group=zero.dp_process_group)
    masters = zero.fp32_partitioned_groups_flat  # [sub-group] flat fp32: this rank's chunk of each of its params
    # Where each parameter's chunk lies: in this run's sub-group flat, and in every saved rank's flat groups (the
    # chunks of all parameters one after the other, whatever the sub-groups).
    placements = []  # (numel, sub-group, offset in it, new chunk, offset in a saved rank's concatenation, old chunk)
    saved_offset = 0
    for group_index, group in enumerate(zero.fp16_groups):
        offset = 0
        for param in group:
            numel, chunk, old_chunk = param.ds_numel, param.partition_numel(), math.ceil(param.ds_numel / saved_ranks)
            placements.append((numel, group_index, offset, chunk, saved_offset, old_chunk))
            offset += chunk
            saved_offset += old_chunk
    states: list[dict[str, Any]] = [{} for _ in masters]
    param_groups = None
    first_shard = None
    for saved_rank, path in enumerate(optimizer_shard_files(checkpoint, saved_ranks)):
        shard = _open_shard(path)
        if param_groups is None:
            param_groups = shard["optimizer_state_dict"]["param_groups"]
            first_shard = shard
        sources = {"": _Concatenation(shard["fp32_flat_groups"])}
        saved_states = shard["optimizer_state_dict"]["state"]
        shapes = [t.numel() for t in shard["fp32_flat_groups"]]
        for key in saved_states.get(0, {}):
            values = [saved_states[g][key] for g in range(len(shapes))]
            if all(torch.is_tensor(v) and v.numel() == n for v, n in zip(values, shapes)):
                sources[key] = _Concatenation(values)
            else:  # the same on every shard (e.g. a step count)
                for group_state in states:
                    group_state[key] = values[0]
        if sources[""].numel != saved_offset:
            raise ValueError(f"{path} holds {sources[''].numel} fp32 elements, this model's chunks over"
                             f" {saved_ranks} ranks {saved_offset}: the checkpoint is of another model.")
        for numel, group, offset, chunk, saved_at, old_chunk in placements:
            lo, hi = max(rank * chunk, saved_rank * old_chunk), min((rank + 1) * chunk, (saved_rank + 1) * old_chunk, numel)
            if lo >= hi:
                continue
            source_at, target_at = saved_at + lo - saved_rank * old_chunk, offset + lo - rank * chunk
            for key, source in sources.items():
                if key:
                    target = states[group].setdefault(key, torch.zeros_like(masters[group].data))
                else:
                    target = masters[group].data
                target[target_at:target_at + hi - lo].copy_(source.slice(source_at, hi - lo))
        del shard, sources, saved_states
    assert param_groups is not None and first_shard is not None
    if len(param_groups) != len(masters):
        raise ValueError(f"{checkpoint} has {len(param_groups)} ZeRO-3 sub-groups and this run {len(masters)}: set"
                         " zero_optimization.sub_group_size so that each parameter group is one sub-group.")
    zero.loss_scaler, zero.dynamic_loss_scale = first_shard["loss_scaler"], first_shard["dynamic_loss_scale"]
    zero._set_fp32_optimizer_param_groups()
    zero.optimizer.load_state_dict({"state": {i: s for i, s in enumerate(states) if s}, "param_groups": param_groups})
    zero._clear_fp32_optimizer_param_groups()
    for group, master in enumerate(masters):  # the weights' partitions from the fp32 masters, as DeepSpeed does
        zero.fp16_partitioned_groups_flat[group].data.copy_(master.data)
        unflat = zero.unflatten(zero.fp16_partitioned_groups_flat[group], zero.fp16_partitioned_groups[group])
        for partitioned, tensor in zip(zero.fp16_partitioned_groups[group], unflat):
            partitioned.data = tensor.data


class _Concatenation:
    """Tensors read as one flat tensor (a saved rank's sub-groups), without concatenating them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = [t.reshape(-1) for t in tensors]
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())
        self.numel = self.starts[-1]

    def slice(self, start: int, length: int) -> torch.Tensor:
        parts = []
        for t, t_start in zip(self.tensors, self.starts):
            lo, hi = max(start, t_start), min(start + length, t_start + t.numel())
            if lo < hi:
                parts.append(t[lo - t_start:hi - t_start])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

"""Load a ZeRO checkpoint on another layout: another number of ranks (dp × sp) or another ZeRO stage (1, 2, 3).

The state is re-partitioned at load, parameter by parameter, from what the saved shards hold:

* **ZeRO 1/2 shards** (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per rank of the ZeRO group): rank ``r``'s
  contiguous piece of each parameter group's flat fp32 master weights and of every optimizer state of the same shape
  (SGD's momentum, Adam's moments), the last piece padded. The pieces of all ranks, concatenated without their
  padding, are the group's flat tensor: its parameters one after the other, in the order of ``param_shapes``.
* **ZeRO 3 shards**: every parameter is cut separately, rank ``r`` holding elements ``[r·c, (r+1)·c)`` of each
  (``c = ceil(numel / ranks)``, the last chunk padded); a rank's flat groups are those chunks one parameter after
  the other, in the order of ``param_shapes``; the optimizer states have the same layout.

So any element of any parameter's master weights or optimizer state is found in the saved shards, and each rank of
the new run fills its own partition (:class:`_SavedZero12` / :class:`_SavedZero3` read, ``_fill_zero12`` /
``_fill_zero3`` write, both by parameter name). The shards are opened **memory-mapped** and only the parts that
overlap this rank's partition are read: the memory of this rank's partition plus one parameter's slice, never the
whole optimizer state. Scalars (step counts) and the parameter groups' hyperparameters (the learning rate the
scheduler reached) are the same in every shard. The weights come through DeepSpeed's loader: the saved module at
ZeRO 1/2, else the model consolidated in fp32 from the saved masters parameter by parameter (the whole model on each
rank once, no optimizer state; DeepSpeed's own consolidation would load every optimizer shard whole). No converted
copy is written, so a crash during loading leaves nothing half-converted behind.

DeepSpeed's universal checkpoints (``ds_to_universal``) cannot serve here: in 0.19.8 the converter reads
``exp_avg``/``exp_avg_sq`` by name, so SGD with momentum fails, and every parameter is written to its own files
(a second copy of the checkpoint). Its elastic ZeRO 1/2 format loads every shard on every rank.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from lightning_ulysses import _compat
from lightning_ulysses.checkpoint.markers import DEEPSPEED_TAG
from lightning_ulysses.parallel.layout import group_rank


def load_on_another_layout(engine: Any, checkpoint: Path, marker: dict[str, Any], load_optimizer: bool,
                           strict: bool) -> Optional[dict[str, Any]]:
    """Load ``checkpoint`` (saved by ``marker["world_size"]`` ranks at ZeRO ``marker["zero_stage"]``) into
    ``engine``: the weights, and with ``load_optimizer`` the optimizer state re-partitioned. Returns the client
    state (Lightning's checkpoint dict), as ``engine.load_checkpoint`` does."""
    saved_ranks, saved_stage = int(marker["world_size"]), int(marker["zero_stage"])
    current_stage_3 = engine.zero_optimization_partition_weights()
    placeholders = saved_stage == 3 and not current_stage_3  # the saved module holds ZeRO-3 placeholders
    saved = _SavedZero3(checkpoint, saved_ranks) if saved_stage == 3 else _SavedZero12(checkpoint, saved_ranks)
    check_same_parameters(engine, saved, checkpoint)

    def consolidated_weights(src: Any, dst: Any) -> None:
        dst.load_state_dict(_consolidated_weights(saved, checkpoint), strict=strict)

    with _model_states_of_the_saved_layout(engine, saved_ranks, saved_stage), _consolidation_from(saved, checkpoint), \
            _frozen_weights_from_the_whole_state(engine):
        _, client_state = engine.load_checkpoint(str(checkpoint), load_optimizer_states=False,
                                                 load_lr_scheduler_states=False, load_module_strict=strict,
                                                 custom_load_fn=consolidated_weights if placeholders else None)
    if client_state is None:
        return None
    if placeholders and engine.optimizer is not None:  # an inference engine has no optimizer
        engine.optimizer.refresh_fp32_params()
    if load_optimizer:
        (_fill_zero3 if current_stage_3 else _fill_zero12)(engine, saved)
    return client_state


def _consolidated_weights(saved: "_Saved", checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole model in fp32 (trainable parameters from the saved masters, one at a time; buffers and frozen
    parameters from the saved module), without DeepSpeed's consolidation, which loads every optimizer shard whole."""
    states, partitioned = saved.model_states, isinstance(saved, _SavedZero3)
    if partitioned and states.get("frozen_param_shapes"):  # partitioned frozen weights: DeepSpeed's way
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_TAG)
    weights = {k: v for k, v in states["module"].items() if not partitioned or k in states.get("buffer_names", [])}
    for group in states["param_shapes"]:
        for param, shape in group.items():
            weights[param] = saved.read(param, "", 0, math.prod(shape)).view(shape).clone()
    return weights


@contextmanager
def _consolidation_from(saved: "_Saved", checkpoint: Path) -> Iterator[None]:
    """DeepSpeed's ZeRO-3 engine takes its weights from ``get_fp32_state_dict_from_zero_checkpoint`` when it loads
    without optimizer states; this run's consolidation (:func:`_consolidated_weights`) stands in for it."""
    import deepspeed.runtime.engine as engine_module

    original = engine_module.get_fp32_state_dict_from_zero_checkpoint
    engine_module.get_fp32_state_dict_from_zero_checkpoint = \
        lambda *args, **kwargs: _consolidated_weights(saved, checkpoint)
    try:
        yield
    finally:
        engine_module.get_fp32_state_dict_from_zero_checkpoint = original


@contextmanager
def _frozen_weights_from_the_whole_state(engine: Any) -> Iterator[None]:
    """After loading the module state, DeepSpeed copies the saved rank's fragment of every frozen parameter (ZeRO
    2/3 checkpoints record them) into this rank's parameter or partition. On another layout the fragments do not fit
    (another partition size; a ZeRO-3 fragment into a whole parameter), and the frozen weights are already in the
    whole module state just loaded: the fragments are dropped."""
    from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS

    original = engine.load_module_state_dict

    def load_module_state_dict(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return original({k: v for k, v in checkpoint.items() if k != FROZEN_PARAM_FRAGMENTS}, *args, **kwargs)

    engine.load_module_state_dict = load_module_state_dict
    try:
        yield
    finally:
        del engine.load_module_state_dict


def check_same_parameters(engine: Any, saved_checkpoint: "_Saved", checkpoint: Path) -> None:
    """Refuse, before anything is loaded, a checkpoint whose trainable parameters (names and shapes, as DeepSpeed
    recorded them) are not this model's."""
    saved = {n: tuple(shape) for group in saved_checkpoint.model_states["param_shapes"] for n, shape in group.items()}
    current = {n: tuple(getattr(p, "ds_shape", p.shape)) for p, n in engine.param_names.items() if p.requires_grad}
    if saved == current:
        return
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    reshaped = sorted(n for n in set(saved) & set(current) if saved[n] != current[n])
    details = "; ".join(part for part in (
        f"not in the checkpoint: {missing[:5]}" if missing else "",
        f"only in the checkpoint: {unexpected[:5]}" if unexpected else "",
        "other shapes: " + ", ".join(f"{n} {saved[n]} -> {current[n]}" for n in reshaped[:5]) if reshaped else "",
    ) if part)
    raise ValueError(f"{checkpoint} holds other trainable parameters than this model ({details}). Resume with the"
                     " model that wrote it; to start from its weights with another model, export them with"
                     " `lightning_ulysses.export_checkpoint(...)` and load what fits.")


@contextmanager
def _model_states_of_the_saved_layout(engine: Any, saved_ranks: int, saved_stage: int) -> Iterator[None]:
    """DeepSpeed's loader opens the model-states file this run would write (``mp_rank_00_model_states.pt`` at ZeRO
    0-2; at ZeRO 3 ``zero_pp_rank_<r>_...`` of its own rank). Point it at the saved layout's file: the client state
    is the same in every rank's file, so ranks beyond the saved ones read rank ``rank % saved_ranks``'s."""
    
    own = group_rank()  # the ZeRO group spans every rank (dp × sp)

    def saved_name(path: Any, tag: Any, mp_placeholder: Any = None, pp_placeholder: Any = None) -> str:
        mp = "00" if mp_placeholder is None else mp_placeholder
        if saved_stage < 3:
            return str(Path(path) / str(tag) / f"mp_rank_{mp}_model_states.pt")
        pp = str(own % saved_ranks) if pp_placeholder is None else pp_placeholder
        return str(Path(path) / str(tag) / f"zero_pp_rank_{pp}_mp_rank_{mp}_model_states.pt")

    with _compat.checkpoint_name_override(engine, saved_name):
        yield


# ----------------------------------------------------------------------------------------------- reading
def optimizer_shard_files(checkpoint: Path, saved_ranks: int) -> list[Path]:
    """The saved ZeRO optimizer shards of a checkpoint directory, by rank of the saving ZeRO group (``bf16_`` first:
    DeepSpeed's name when training in bf16)."""
    folder = Path(checkpoint) / DEEPSPEED_TAG
    files = []
    for r in range(saved_ranks):
        names = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for prefix in ("bf16_", "")]
        found = [folder / name for name in names if (folder / name).is_file()]
        if not found:
            raise ValueError(f"{checkpoint} lacks the optimizer shard of rank {r} of its {saved_ranks} saving ranks.")
        files.append(found[0])
    return files


def _open(path: Path) -> dict[str, Any]:
    """A saved file, its tensors memory-mapped (read from disk only where sliced)."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


class _Concatenation:
    """Flat tensors read as one flat tensor, without concatenating them."""

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


class _Saved:
    """What the saved shards hold, read by parameter name: ``read(name, key, lo, hi)`` gives elements ``[lo, hi)``
    of that parameter's fp32 master (``key=""``) or optimizer state ``key``, flattened."""

    model_states: dict[str, Any]  # the saved model-states file (rank 0's at ZeRO 3), memory-mapped
    state_keys: list[str]  # the optimizer states shaped like the masters
    scalars: dict[str, Any]  # the others (the same on every shard)
    param_groups: list[dict[str, Any]]
    global_state: dict[str, Any]  # loss scaler etc. of the first shard

    def read(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError

    def _split_states(self, states: dict[str, Any], numel: int) -> None:
        self.state_keys, self.scalars = [], {}
        for key, value in states.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() >= numel:
                self.state_keys.append(key)
            else:
                self.scalars[key] = value


class _SavedZero12(_Saved):
    def __init__(self, checkpoint: Path, saved_ranks: int) -> None:
        shards = [_open(f)["optimizer_state_dict"] for f in optimizer_shard_files(checkpoint, saved_ranks)]
        if not all(isinstance(s["base_optimizer_state"], dict) for s in shards):
            raise ValueError(f"{checkpoint} is an elastic ZeRO checkpoint; only the default (rigid) layout is resharded.")
        if any(any(p) for s in shards for p in s.get("param_alignment_paddings", []) or []):
            raise ValueError(f"{checkpoint} was saved with zero_optimization.parameter_alignment: not resharded.")
        self.model_states = _open(Path(checkpoint) / DEEPSPEED_TAG / "mp_rank_00_model_states.pt")
        param_shapes = self.model_states["param_shapes"]
        first = shards[0]
        self.param_groups = first["base_optimizer_state"]["param_groups"]
        self.global_state = {k: v for k, v in first.items()
                             if k not in ("base_optimizer_state", "single_partition_of_fp32_groups")}
        pieces = [[s["single_partition_of_fp32_groups"][g] for s in shards] for g in range(len(param_shapes))]
        self._split_states(first["base_optimizer_state"]["state"].get(0, {}), pieces[0][0].numel())
        self.sources: list[dict[str, _Concatenation]] = []
        for g, group_pieces in enumerate(pieces):
            sizes = [p.numel() for p in group_pieces]
            sources = {"": _Concatenation(group_pieces)}
            for key in self.state_keys:  # each shard's state without its padding
                sources[key] = _Concatenation([s["base_optimizer_state"]["state"][g][key][:n]
                                               for s, n in zip(shards, sizes)])
            self.sources.append(sources)
        self.where: dict[str, tuple[int, int]] = {}  # name -> (group, offset in the group's flat tensor)
        for g, shapes in enumerate(param_shapes):
            offset = 0
            for name, shape in shapes.items():
                self.where[name] = (g, offset)
                offset += math.prod(shape)

    def read(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        group, offset = self.where[name]
        return self.sources[group][key].slice(offset + lo, hi - lo)


class _SavedZero3(_Saved):
    def __init__(self, checkpoint: Path, saved_ranks: int) -> None:
        shards = [_open(f)["optimizer_state_dict"] for f in optimizer_shard_files(checkpoint, saved_ranks)]
        self.model_states = _open(Path(checkpoint) / DEEPSPEED_TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        param_shapes = self.model_states["param_shapes"]
        first = shards[0]
        self.param_groups = first["optimizer_state_dict"]["param_groups"]
        self.global_state = {k: v for k, v in first.items() if k not in ("optimizer_state_dict", "fp32_flat_groups")}
        self._split_states(first["optimizer_state_dict"]["state"].get(0, {}), first["fp32_flat_groups"][0].numel())
        self.ranks = saved_ranks
        self.sources = []  # per saved rank: key -> its flat groups read as one
        for s in shards:
            flats = s["fp32_flat_groups"]
            sources = {"": _Concatenation(flats)}
            for key in self.state_keys:
                sources[key] = _Concatenation([s["optimizer_state_dict"]["state"][g][key] for g in range(len(flats))])
            self.sources.append(sources)
        self.where: dict[str, tuple[int, int, int]] = {}  # name -> (numel, chunk, offset in a rank's concatenation)
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                chunk = math.ceil(numel / saved_ranks)
                self.where[name] = (numel, chunk, offset)
                offset += chunk
        if self.sources[0][""].numel != offset:
            raise ValueError(f"{checkpoint}: its shards hold {self.sources[0][''].numel} fp32 elements per rank, its"
                             f" parameters' chunks {offset}.")

    def read(self, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        numel, chunk, offset = self.where[name]
        parts = []
        for r in range(lo // chunk, (hi - 1) // chunk + 1):
            r_lo, r_hi = max(lo, r * chunk), min(hi, (r + 1) * chunk)
            parts.append(self.sources[r][key].slice(offset + r_lo - r * chunk, r_hi - r_lo))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# ----------------------------------------------------------------------------------------------- writing
def _fill_zero12(engine: Any, saved: _Saved) -> None:
    """This rank's ZeRO 1/2 partitions (fp32 masters, optimizer states) from ``saved``."""
    
    zero = engine.optimizer  # deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer
    if getattr(zero, "round_robin_gradients", False) or any(any(p) for p in zero.round_robin_bit16_padding):
        raise ValueError("Resharding a checkpoint needs zero_optimization.round_robin_gradients and"
                         " parameter_alignment off (their flat layout depends on the number of ranks).")
    masters = zero.single_partition_of_fp32_groups
    states = [_new_states(saved, m) for m in masters]
    for g, (params, offsets) in enumerate(zip(zero.round_robin_bit16_groups, zero.round_robin_bit16_offsets)):
        size = masters[g].numel()
        start = group_rank(zero.real_dp_process_group[g]) * size
        for param, offset in zip(params, offsets):
            lo, hi = max(offset, start), min(offset + param.numel(), start + size)
            if lo < hi:
                _copy(saved, zero.param_names[param], lo - offset, hi - offset, masters[g].data, states[g], lo - start)
    _load_loss_scaling(zero, saved)
    zero.optimizer.load_state_dict({"state": dict(enumerate(states)),
                                    "param_groups": _param_groups(saved, len(masters))})
    _compat.link_hp_params(zero)


def _fill_zero3(engine: Any, saved: _Saved) -> None:
    """This rank's ZeRO 3 partitions (fp32 masters, optimizer states, and from the masters the weights' partitions)
    from ``saved``."""
    
    zero = engine.optimizer  # deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3
    rank = group_rank(zero.dp_process_group)
    masters = zero.fp32_partitioned_groups_flat
    states = [_new_states(saved, m) for m in masters]
    for g, params in enumerate(zero.fp16_groups):
        offset = 0
        for param in params:
            chunk = param.partition_numel()
            lo, hi = rank * chunk, min((rank + 1) * chunk, _compat.zero3_numel(param))
            if lo < hi:
                _copy(saved, engine.param_names[param], lo, hi, masters[g].data, states[g], offset)
            offset += chunk
    _load_loss_scaling(zero, saved)
    _compat.set_fp32_param_groups(zero, True)
    zero.optimizer.load_state_dict({"state": dict(enumerate(states)),
                                    "param_groups": _param_groups(saved, len(masters))})
    _compat.set_fp32_param_groups(zero, False)
    for g, master in enumerate(masters):  # the weights' partitions from the fp32 masters, as DeepSpeed does
        zero.fp16_partitioned_groups_flat[g].data.copy_(master.data)
        unflat = zero.unflatten(zero.fp16_partitioned_groups_flat[g], zero.fp16_partitioned_groups[g])
        for partitioned, tensor in zip(zero.fp16_partitioned_groups[g], unflat):
            partitioned.data = tensor.data


def _load_loss_scaling(zero: Any, saved: _Saved) -> None:
    """The fp16 loss scaler's state, as DeepSpeed's loaders restore it (kept by every stage's shards)."""
    for name in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        if name in saved.global_state:
            setattr(zero, name, saved.global_state[name])


def _new_states(saved: _Saved, master: torch.Tensor) -> dict[str, Any]:
    return {**{key: torch.zeros_like(master.data) for key in saved.state_keys}, **saved.scalars}


def _copy(saved: _Saved, name: str, lo: int, hi: int, master: torch.Tensor, states: dict[str, Any], at: int) -> None:
    """Elements ``[lo, hi)`` of parameter ``name``'s master and states into ``master[at:]`` / ``states[key][at:]``."""
    master[at:at + hi - lo].copy_(saved.read(name, "", lo, hi))
    for key in saved.state_keys:
        states[key][at:at + hi - lo].copy_(saved.read(name, key, lo, hi))


def _param_groups(saved: _Saved, count: int) -> list[dict[str, Any]]:
    """The saved hyperparameters for this run's ``count`` optimizer groups: one to one, or the same for all when the
    saved groups agree (ZeRO 3 sub-groups of one parameter group)."""
    groups = [{**g, "params": [i]} for i, g in enumerate(saved.param_groups)]
    if len(groups) == count:
        return groups
    settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    if all(s == settings[0] for s in settings):
        return [{**settings[0], "params": [i]} for i in range(count)]
    raise ValueError(f"The checkpoint has {len(groups)} optimizer groups with different settings and this run"
                     f" {count}: resharding keeps the groups one to one.")

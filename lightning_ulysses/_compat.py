"""Every place the package relies on a private API of Lightning, DeepSpeed, torch or transformers, in one module.

A private name, signature or behaviour can change in any release without notice. Each touch point here has a guard
in ``tests/test_compat.py`` that fails when the upstream code it relies on changes (its name, its signature, a digest
of its source where the behaviour matters, or the behaviour itself), so that an upgrade breaks a named test instead of
training silently wrong. The rest of the package calls these functions and never the private names.

Lightning (2.6):
    :func:`window_continues` (``fit_loop._should_accumulate``), :func:`continue_epoch_at` (the train epoch's batch
    progress), :func:`train_loader_of` (``fit_loop._data_source``), :func:`attached_trainer`
    (``LightningModule._trainer``), :func:`set_device_mesh` (``LightningModule._device_mesh``),
    :func:`remove_module_hooks`, :data:`BATCH_PROGRESS_KEY` (the loop state's key in a checkpoint), and the strategy's
    overrides of ``DeepSpeedStrategy._setup_model_and_optimizer`` / ``_initialize_deepspeed_inference`` /
    ``_auto_select_batch_size`` (:func:`initialize_training_engine`, :func:`initialize_inference_engine`).
Lightning Fabric (2.6):
    the Fabric front end's overrides of ``DeepSpeedStrategy._setup_distributed`` (:func:`format_fabric_deepspeed_config`
    is its tail) and ``_initialize_engine`` (:func:`initialize_training_engine`), :func:`move_state_into`
    (``_move_state_into``), and ``_BackwardSyncControl``, which ``fabric.no_backward_sync`` calls.
DeepSpeed (0.19):
    :func:`checkpoint_name_override` (``engine._get_ckpt_name``), :func:`link_hp_params`
    (``optimizer._link_all_hp_params``), :func:`restore_from_bit16_override`
    (``optimizer._restore_from_bit16_weights``), the ZeRO optimizer attributes :data:`ZERO12_STATE` /
    :data:`ZERO3_STATE` that re-partitioning reads, and ZeRO-3's parameter attributes (:func:`is_zero3_gathered`,
    :func:`is_zero3_released`, :func:`defer_zero3_gradient`), ZeRO-3's flat gradient-partition buffer
    (:func:`clear_zero3_gradient_partitions`).
torch (2.13):
    the private attention ops with log-sum-exp output the ring kernels call (:func:`cpu_flash_attention`,
    :func:`cpu_flash_attention_backward`, :func:`efficient_attention`, :func:`efficient_attention_backward`); a
    storage's identity and use count (``untyped_storage()._cdata``, ``torch._C._storage_Use_Count``:
    :func:`storage_key`, :func:`storage_use_count`) and freeing one in place (:func:`release_storage`).
transformers (5.x):
    ``config._attn_implementation`` (:func:`attention_implementation`, :func:`set_attention_implementation`), the
    ZeRO-3 switch (:func:`transformers_deepspeed_config`), ``PreTrainedModel._from_config`` (:func:`model_from_config`).
torch's ``nn.Module`` hook registries: :func:`hook_is_registered`.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

# ============================================================================================== Lightning


def attached_trainer(lightning_module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (``lightning_module.trainer`` raises instead)."""
    return getattr(lightning_module, "_trainer", None) if lightning_module is not None else None


def set_device_mesh(lightning_module: Any, mesh: Any) -> None:
    """Make ``lightning_module.device_mesh`` return ``mesh`` (Lightning's ``ModelParallelStrategy`` sets the same
    private attribute)."""
    lightning_module._device_mesh = mesh


def window_continues(trainer: Any) -> bool:
    """Lightning's decision for the coming training micro-batch: ``True`` when it accumulates (no optimizer step after
    it), ``False`` when it ends an accumulation window (every ``accumulate_grad_batches`` batches and at the end of
    the epoch)."""
    return bool(trainer.fit_loop._should_accumulate())


def continue_epoch_at(trainer: Any, batch: int) -> None:
    """A resume with another global batch continues the train epoch at ``batch`` of this run's batches: Lightning's
    count of the epoch's batches (restored from the checkpoint in the saving run's batches) follows, so the epoch
    ends with the loader. The saved counts' differences are kept (a save inside the batch's end hooks)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batch - current.ready
    current.ready, current.started = current.ready + shift, current.started + shift
    current.processed, current.completed = current.processed + shift, current.completed + shift


def train_loader_of(trainer: Any) -> Optional[Any]:
    """The train DataLoader the LightningModule or datamodule defines (before Lightning wraps it), or ``None``."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None


def remove_module_hooks(model: torch.nn.Module) -> None:
    """Lightning's clean-up of every module's hooks before its DeepSpeed inference engine."""
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks as lightning_remove_module_hooks

    lightning_remove_module_hooks(model)


# The hook registries Lightning's remove_module_hooks empties (each an OrderedDict of hook id -> hook).
_HOOK_REGISTRIES = ("_backward_hooks", "_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks",
                    "_load_state_dict_pre_hooks")
# Hooks of these packages are not the user's: DeepSpeed's (a previous engine's ZeRO-3 gathering, which Lightning's
# clean-up exists to remove) and the strategy's own (installed again by the strategy itself).
_NOT_USER_HOOKS = ("deepspeed", "lightning_ulysses")


def _hook_package(hook: Any) -> str:
    function = getattr(hook, "func", hook)  # a functools.partial
    function = getattr(function, "__func__", function)  # a bound method
    return (getattr(function, "__module__", None) or type(function).__module__ or "").partition(".")[0]


def user_module_hooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, dict[int, Any], Any]]:
    """Every module's hooks that are neither DeepSpeed's nor the strategy's (a user's forward hooks that keep
    activations, a monitor's): ``(module, registry, {id: hook}, full-backward flag)``, for :func:`restore_user_hooks`
    after Lightning's :func:`remove_module_hooks`, which drops them all (on one device they stay and fire)."""
    kept = []
    for module in model.modules():
        for registry in _HOOK_REGISTRIES:
            hooks = {key: hook for key, hook in getattr(module, registry, {}).items()
                     if _hook_package(hook) not in _NOT_USER_HOOKS}
            if hooks:
                kept.append((module, registry, hooks, getattr(module, "_is_full_backward_hook", None)))
    return kept


# Packages whose hooks are part of what a model computes (transformers records router logits and hidden states with
# forward hooks, peft and accelerate wrap modules with them): they run in the form check's probe too.
_MODEL_LIBRARIES = ("torch", "transformers", "accelerate", "peft", "deepspeed", "lightning_ulysses", "lightning",
                    "pytorch_lightning", "litgpt", "bitsandbytes", "torchao")


def _silenced_hooks(roots: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, dict[int, Any], Any]]:
    kept = [(module, registry, {key: hook for key, hook in hooks.items()
                                if _hook_package(hook) not in _MODEL_LIBRARIES}, flag)
            for root in roots for module, registry, hooks, flag in user_module_hooks(root)]
    return [entry for entry in kept if entry[2]]


def has_user_hooks(roots: list[torch.nn.Module]) -> bool:
    """Whether any module of ``roots`` has a hook that :func:`user_hooks_silenced` would silence."""
    return bool(_silenced_hooks(roots))


@contextmanager
def user_hooks_silenced(roots: list[torch.nn.Module]) -> Iterator[None]:
    """Inside the block, the hooks of every module of ``roots`` that no model library registered (the user's own
    code's: a monitor, an activation capture) do not run: the strategy's own probe of the model (its form check) is
    not one of the user's forwards, and a hook that keeps outputs or counts calls must see only those. Put back
    afterwards under their ids, in their order."""
    kept = _silenced_hooks(roots)
    for module, registry, hooks, _ in kept:
        setattr(module, registry, OrderedDict((key, hook) for key, hook in getattr(module, registry).items()
                                              if key not in hooks))
    try:
        yield
    finally:
        restore_user_hooks(kept)


def restore_user_hooks(kept: list[tuple[torch.nn.Module, str, dict[int, Any], Any]]) -> None:
    """Put :func:`user_module_hooks`' hooks back under their ids, in the order of their ids (the order they were
    registered in, before any registered since)."""
    for module, registry, hooks, full_backward in kept:
        merged = dict(getattr(module, registry))
        merged.update(hooks)
        setattr(module, registry, OrderedDict(sorted(merged.items())))
        if registry == "_backward_hooks":
            module._is_full_backward_hook = full_backward


BATCH_PROGRESS_KEY = "epoch_loop.batch_progress"  # the train epoch's batch progress in checkpoint["loops"]["fit_loop"]


def device_rank(strategy: Any) -> int:
    """The device rank DeepSpeed takes from its ``args``: Lightning passes ``root_device.index``, which is ``None`` on
    CPU and breaks DeepSpeed's rank arithmetic; the local rank then."""
    index = strategy.root_device.index
    return strategy.local_rank if index is None else index


def _deepspeed_args(strategy: Any) -> argparse.Namespace:
    return argparse.Namespace(device_rank=device_rank(strategy))


def initialize_training_engine(strategy: Any, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any,
                               mpu: Any) -> tuple[Any, Any, Any]:
    """The body of Lightning's ``DeepSpeedStrategy._setup_model_and_optimizer`` (and of Fabric's
    ``DeepSpeedStrategy._initialize_engine``, the same call) with ``mpu`` added (DeepSpeed then takes the
    data-parallel world for its batch arithmetic and reduces gradients over DP×SP) and the device rank fixed for CPU.
    Returns the engine, its optimizer and its scheduler."""
    import deepspeed

    model_parameters = filter(lambda p: p.requires_grad, model.parameters())
    engine, deepspeed_optimizer, _, deepspeed_scheduler = deepspeed.initialize(
        args=_deepspeed_args(strategy),
        config=strategy.config,
        model=model,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dist_init_required=False,
        mpu=mpu,
    )
    return engine, deepspeed_optimizer, deepspeed_scheduler


def format_fabric_deepspeed_config(strategy: Any) -> None:
    """The end of Fabric's ``DeepSpeedStrategy._setup_distributed`` (its CUDA device-index check left out, which CPU
    devices without an index fail): the DeepSpeed config completed once (micro-batch size, precision)."""
    if not strategy._config_initialized:
        strategy._format_config()
        strategy._config_initialized = True


def move_state_into(source: dict, destination: dict, keys: set) -> None:
    """Fabric's ``_move_state_into``: the saved state of ``keys`` into the objects of ``destination`` (in place where
    they are stateful), as Fabric's ``load`` does after DeepSpeed loaded a checkpoint."""
    from lightning.fabric.utilities.load import _move_state_into

    _move_state_into(source=source, destination=destination, keys=keys)


def initialize_inference_engine(strategy: Any, model: torch.nn.Module, mpu: Any,
                                after_hooks_removed: Optional[Callable[[], None]]) -> Any:
    """The body of Lightning's ``DeepSpeedStrategy._initialize_deepspeed_inference`` with ``mpu`` added;
    ``after_hooks_removed()`` runs after Lightning's ``remove_module_hooks`` (the strategy installs its own
    pre-hooks again there). ``None``: the module's hooks are left alone (Fabric's ``setup_module``, for which this
    is the engine without an optimizer: ZeRO 1-2 need one, so only ZeRO-3's settings are passed on). Returns the
    engine."""
    import deepspeed

    config = strategy.config
    inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            inference_config[key] = config[key]
    if strategy.zero_stage_3:
        inference_config["zero_allow_untested_optimizer"] = config["zero_allow_untested_optimizer"]
        inference_config["zero_optimization"] = config["zero_optimization"]
    if after_hooks_removed is not None:
        users_hooks = user_module_hooks(model)
        remove_module_hooks(model)
        restore_user_hooks(users_hooks)  # a user's hooks fire in validate/test/predict as on one device
        after_hooks_removed()
    engine, _, _, _ = deepspeed.initialize(
        args=_deepspeed_args(strategy),
        config=inference_config,
        model=model,
        optimizer=None,
        lr_scheduler=None,
        model_parameters=[],
        dist_init_required=False,
        mpu=mpu,
    )
    return engine


# ============================================================================================== DeepSpeed
ZERO12_STATE = ("round_robin_bit16_groups", "round_robin_bit16_offsets", "round_robin_bit16_padding",
                "single_partition_of_fp32_groups", "real_dp_process_group", "param_names", "optimizer")
"""Attributes of DeepSpeed's ZeRO 1/2 optimizer that re-partitioning a checkpoint reads (resharding.py)."""
ZERO3_STATE = ("fp16_groups", "fp16_partitioned_groups", "fp16_partitioned_groups_flat",
               "fp32_partitioned_groups_flat", "dp_process_group", "param_names", "optimizer")
"""Attributes of DeepSpeed's ZeRO 3 optimizer that re-partitioning a checkpoint reads (resharding.py)."""


@contextmanager
def checkpoint_name_override(engine: Any, name: Callable[..., str]) -> Iterator[None]:
    """DeepSpeed's engine reads its model-states file names from ``engine._get_ckpt_name(path, tag, mp, pp)``:
    ``name`` answers instead inside the block."""
    engine._get_ckpt_name = name
    try:
        yield
    finally:
        del engine._get_ckpt_name


def link_hp_params(zero_optimizer: Any) -> None:
    """Re-link every parameter's fp32 master fragment after the ZeRO 1/2 masters were rewritten."""
    zero_optimizer._link_all_hp_params()


def set_fp32_param_groups(zero_optimizer: Any, set_them: bool) -> None:
    """ZeRO 3: attach (``True``) or detach the fp32 partitions to the wrapped optimizer's param groups around
    loading its state dict."""
    if set_them:
        zero_optimizer._set_fp32_optimizer_param_groups()
    else:
        zero_optimizer._clear_fp32_optimizer_param_groups()


@contextmanager
def restore_from_bit16_override(optimizer: Any, restore: Callable[[], None]) -> Iterator[None]:
    """DeepSpeed's checkpoint loading ends with ``optimizer._restore_from_bit16_weights()``; an optimizer without it
    (ZeRO-3's parameter-offload stand-in of an inference engine) runs ``restore`` there instead."""
    optimizer._restore_from_bit16_weights = restore
    try:
        yield
    finally:
        del optimizer._restore_from_bit16_weights


def clear_zero3_gradient_partitions(zero3_optimizer: Any) -> None:
    """Zero ZeRO-3's flat buffer of gradient partitions. DeepSpeed writes a parameter's gradient partition into it when
    the parameter's gradient arrives and never clears it, so a parameter that a later step does not use would get its
    old gradient applied again (measured: 0.1 per SGD step); cleared after every optimizer step, an unused parameter
    gets gradient 0, as on one device."""
    buffer = getattr(zero3_optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None:
        buffer.zero_()


@contextmanager
def zero3_forward_discovery(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Run ``modules`` outside ``DeepSpeedEngine.forward`` (the model-form check's probe) as the engine's forward runs
    them under ZeRO-3: a parameter that one module reads from another (DBRX's and JetMoE's experts read their
    parent's) is gathered when it is read, as the engine's forward prologue arranges (``_parameters._in_forward``).
    A no-op without partitioned parameters."""
    every = [m for root in modules for m in root.modules()]
    if not any(is_zero3_param(p) for m in every for p in m.parameters(recurse=False)):
        yield
        return
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    for module in every:
        ensure_zero_ordered_dict(module)
        if isinstance(module._parameters, ZeROOrderedDict):
            module._parameters._in_forward = True
    try:
        yield
    finally:
        for module in every:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False


def make_zero3_leaf_modules(modules: list[torch.nn.Module]) -> Callable[[], None]:
    """Mark ``modules`` as ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``'s flag, per instance): each
    gathers all its parameters around its call, with no hooks inside. Returns the undo."""
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_module, z3_leaf_module

    marked = [m for m in modules if not z3_leaf_module(m)]
    for module in marked:
        set_z3_leaf_module(module, True)
    return lambda: [set_z3_leaf_module(m, False) for m in marked] and None


def restart_zero3_trace(engine: Any) -> None:
    """Forget the module trace ZeRO-3's parameter coordinator recorded while the model ran outside the engine's
    forward (the model-form check's probe). The coordinator records the order of module calls to prefetch by it and,
    at the next forward, checks that every rank recorded the same order: a probe of a few tokens per rank can route
    them to different experts per rank (DBRX calls an expert module once per expert hit), and that check, or a
    prefetch by a trace the step does not follow, would stop or hang the first step. Invalidated, the trace is
    recorded afresh by the first real step, as it is without the probe. The parameters the probe left gathered
    (those read from another module are gathered on the read and may stay so, differently per rank) are
    partitioned again. A no-op without ZeRO-3."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)  # the inference engine's ZeRO-3 is the offload itself
    coordinator_of = getattr(offload, "get_param_coordinator", None)
    if coordinator_of is None:
        return
    coordinator = coordinator_of()
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # also waits for and releases the gathers in flight
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in engine.module.parameters():  # every rank starts the step with the same parameters gathered: none
        if is_zero3_param(param) and param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_persist:
            param.ds_active_sub_modules.clear()
            param.partition()


def has_restore_from_bit16(optimizer: Any) -> bool:
    return hasattr(optimizer, "_restore_from_bit16_weights")


def is_zero3_param(tensor: Any) -> bool:
    return hasattr(tensor, "ds_id")


def is_zero3_gathered(tensor: Any) -> bool:
    """A ZeRO-3 parameter whose full data is present on this rank now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return is_zero3_param(tensor) and tensor.ds_status == ZeroParamStatus.AVAILABLE


def is_zero3_released(tensor: Any) -> bool:
    """A ZeRO-3 parameter that holds only its partition on this rank now (a ``[0]`` placeholder as ``data``)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return is_zero3_param(tensor) and tensor.ds_status == ZeroParamStatus.NOT_AVAILABLE


def zero3_numel(tensor: Any) -> int:
    """Elements of a ZeRO-3 parameter's full tensor."""
    return int(tensor.ds_numel)


def defer_zero3_gradient(param: Any, ready: bool) -> None:
    """ZeRO reduces a weight's gradient when autograd's hook fires unless ``ds_grad_is_ready`` is ``False``: a weight
    whose gradient is accumulated over several partial backward passes (tiles) is reduced after the last one."""
    param.ds_grad_is_ready = ready


# ============================================================================================== torch
def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (shared by its views; meta tensors' storages too): the storage object's C
    address, unique while the storage lives."""
    return tensor.untyped_storage()._cdata


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references ``tensor``'s storage has (the tensors viewing it among them)."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata)


_LONE = torch.empty(1)
LONE_STORAGE_USE_COUNT = storage_use_count(_LONE)  # a storage that one tensor alone views, as this torch counts it
del _LONE

STORAGE_RELEASED: list[Callable[[int, int], None]] = []  # (storage key, bytes) of each release_storage: observers


def release_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s storage in place (``resize_(0)``: its shape stays, its bytes go back to the allocator, which
    waits for the streams recorded on it); :data:`STORAGE_RELEASED`'s observers (a memory tracker, which sees no
    operation here) are told. Reading the tensor afterwards is undefined: callers free only what nothing reads."""
    storage = tensor.untyped_storage()
    key, nbytes = storage._cdata, storage.nbytes()
    storage.resize_(0)
    for observer in list(STORAGE_RELEASED):
        observer(key, nbytes)


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        additive_mask: Optional[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, h, cq, D], lse [B, h, cq])`` of torch's CPU flash-attention op."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, attn_mask=additive_mask, scale=scale)
    return out, lse


def cpu_flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                 additive_mask: Optional[torch.Tensor], scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of torch's CPU flash-attention op from the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        0.0, causal, attn_mask=additive_mask, scale=scale)


def efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                        causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, h, cq, D], lse [B, h, ceil(cq/32)·32])`` of torch's CUDA memory-efficient attention op (its lse is
    padded)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), bias, True, 0.0, causal, scale=scale)
    return out, lse


def efficient_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 bias: Optional[torch.Tensor], out: torch.Tensor, padded_lse: torch.Tensor,
                                 causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of torch's memory-efficient attention op (``padded_lse`` in the op's padded layout)."""
    no_dropout = torch.zeros((), dtype=torch.long)  # philox seed and offset: unused without dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), bias, out.contiguous(), padded_lse,
        no_dropout, no_dropout, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def compile_wrapper_class() -> Any:
    """The class of ``torch.compile(module)``'s wrapper (dynamo's ``OptimizedModule``), ``None`` without dynamo."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return OptimizedModule


def hook_is_registered(module: torch.nn.Module, handle: Any) -> bool:
    """Whether the forward (pre-)hook behind ``handle`` is still registered on ``module`` (something may have cleared
    the module's hooks, as Lightning's inference set-up does)."""
    return handle.id in module._forward_pre_hooks or handle.id in module._forward_hooks


# ============================================================================================== transformers
@contextmanager
def transformers_deepspeed_config(ds_config: dict) -> Iterator[None]:
    """transformers' process-global "ZeRO-3 is active" state (a weak reference to an ``HfDeepSpeedConfig``) set to
    ``ds_config`` inside the block and put back as it was after it."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_deepspeed

    previous = hf_deepspeed._hf_deepspeed_config_weak_ref
    keep_alive = HfDeepSpeedConfig(ds_config)  # registers itself through a weak reference
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = previous
        del keep_alive


def model_from_config(model_class: Any, config: Any, **kwargs: Any) -> Any:
    """``model_class`` built from ``config`` with fresh weights: transformers' ``_from_config`` (what the Auto classes'
    ``from_config`` calls), which takes a concrete class."""
    return model_class._from_config(config, **kwargs)


# The prefix of the attention implementations the strategy registers in transformers' attention interface
# (``ulysses_sdpa`` wraps ``sdpa``, ...).
ATTENTION_PREFIX = "ulysses_"


def inner_attention_implementation(config: Any) -> str:
    """The config's attention implementation without the strategy's prefix (``sdpa``, ``flash_attention_2``, ...)."""
    return attention_implementation(config).removeprefix(ATTENTION_PREFIX)


def attention_implementation(config: Any) -> str:
    """The attention implementation a transformers config dispatches to (``"sdpa"``, ``"flash_attention_2"``, ...)."""
    return config._attn_implementation


def set_attention_implementation(config: Any, name: str) -> None:
    """Point a transformers config (and its sub-configs) at the attention function registered as ``name``; unlike
    ``model.set_attn_implementation`` it takes any registered name and does not check the model class."""
    config._attn_implementation = name

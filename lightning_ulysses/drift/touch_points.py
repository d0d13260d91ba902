"""Every private touch point of :mod:`lightning_ulysses._compat` as a check that says whether the upstream code it
relies on is still the code the package was written against.

One registry, two users:

* ``tests/test_compat.py`` runs every check on the installed stack (a failing check is a named test failure);
* :mod:`lightning_ulysses.drift.guard` runs the checks of the libraries whose installed version was never tested,
  once per process before the first step, and stops the run when one fails.

A check raises :class:`TouchPointChanged` (or any error: a moved import or a missing attribute is a change too) and
returns nothing when the touch point is as expected. Checks read sources, signatures and op schemas, and run a few
behaviours on tensors of a handful of elements: no Trainer, no process group, nothing that touches the user's model.
The digests are SHA-256 prefixes of the dedented source (:func:`source_digest`): a new digest means upstream changed
the method; compare the code that copies or relies on it, then update the digest here.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lightning_ulysses import _compat

TRAINER, FABRIC = "trainer", "fabric"
BOTH = frozenset({TRAINER, FABRIC})


class TouchPointChanged(AssertionError):
    """The upstream code behind a touch point is not the code the package relies on."""


@dataclass(frozen=True)
class TouchPoint:
    """One private API the package relies on: ``package`` is the library whose change can break it, ``front_ends``
    the front ends that use it (``"trainer"``, ``"fabric"``), ``check`` raises when it changed."""

    name: str
    package: str
    front_ends: frozenset
    check: Callable[[], None]

    def problem(self) -> str | None:
        """``None`` when the touch point is unchanged, else what changed (one line)."""
        try:
            self.check()
        except Exception as err:  # a moved module or attribute is a change as much as a new digest
            text = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return f"{type(err).__name__}: {text}" if not isinstance(err, TouchPointChanged) else text
        return None


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise TouchPointChanged(what)


def source_digest(function: Callable) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(function)).encode()).hexdigest()[:16]


def _parameters(function: Callable) -> list[str]:
    return list(inspect.signature(function).parameters)


def initialize_keywords(function: Callable) -> set:
    """The keywords of the one ``deepspeed.initialize(...)`` call in ``function``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "initialize"]
    expect(len(calls) == 1, f"{function.__qualname__} no longer makes one deepspeed.initialize call")
    return {keyword.arg for keyword in calls[0].keywords}


REGISTRY: list[TouchPoint] = []


def touch_point(name: str, package: str, front_ends: frozenset = BOTH):
    def register(check: Callable[[], None]) -> Callable[[], None]:
        REGISTRY.append(TouchPoint(name, package, frozenset(front_ends), check))
        return check
    return register


# ================================================================================================ Lightning
# Lightning's private engine set-up methods as _compat.py copied them (lightning 2.6.x).
LIGHTNING_ENGINE_SETUP = {"_setup_model_and_optimizer": ("d5b228d023b53b92", _compat.initialize_training_engine),
                          "_initialize_deepspeed_inference": ("44374170d2e2a741", _compat.initialize_inference_engine)}


def _engine_setup_check(name: str) -> Callable[[], None]:
    def check() -> None:
        """Lightning's method is the one ``_compat``'s body was copied from (its source digest; the strategy's
        override takes the same arguments, pinned by tests/test_compat.py), and ``_compat``'s body passes
        ``deepspeed.initialize`` the same keywords plus ``mpu``."""
        from lightning.pytorch.strategies import DeepSpeedStrategy

        digest, body = LIGHTNING_ENGINE_SETUP[name]
        theirs = getattr(DeepSpeedStrategy, name)
        expect(source_digest(theirs) == digest, f"Lightning changed DeepSpeedStrategy.{name} (source digest"
                                                f" {source_digest(theirs)}, written against {digest})")
        expect(initialize_keywords(body) == initialize_keywords(theirs) | {"mpu"},
               f"DeepSpeedStrategy.{name} passes deepspeed.initialize other keywords")
    return check


for _name in sorted(LIGHTNING_ENGINE_SETUP):
    touch_point(f"lightning: DeepSpeedStrategy.{_name}", "lightning", {TRAINER})(_engine_setup_check(_name))


@touch_point("lightning: DeepSpeedStrategy._auto_select_batch_size", "lightning", {TRAINER})
def _auto_select_batch_size() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    expect(_parameters(DeepSpeedStrategy._auto_select_batch_size) == ["self"], "it takes other arguments")
    expect("batch_sampler.batch_size" in inspect.getsource(DeepSpeedStrategy._auto_select_batch_size),
           "it no longer reads the train loader's batch_sampler.batch_size")


@touch_point("lightning: the fit loop's accumulation window, batch progress and train loader", "lightning",
             {TRAINER})
def _fit_loop() -> None:
    """What ``window_continues``, ``continue_epoch_at``, ``train_loader_of`` and ``BATCH_PROGRESS_KEY`` read (their
    behaviour on a real fit is pinned by tests/test_compat.py)."""
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.progress import _BatchProgress
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    expect(_parameters(_FitLoop._should_accumulate) == ["self"], "_FitLoop._should_accumulate changed")
    expect("self._data_source = _DataLoaderSource(" in inspect.getsource(_FitLoop.__init__),
           "_FitLoop no longer keeps its train loader source in _data_source")
    expect("self.batch_progress = _BatchProgress()" in inspect.getsource(_TrainingEpochLoop.__init__),
           "the train epoch loop no longer keeps a _BatchProgress in batch_progress")
    current = _BatchProgress().current
    expect(all(hasattr(current, field) for field in ("ready", "started", "processed", "completed")),
           "_BatchProgress.current no longer counts ready/started/processed/completed")
    expect(_compat.BATCH_PROGRESS_KEY.split(".")[0] == "epoch_loop", "the train epoch loop's state key changed")


@touch_point("lightning: remove_module_hooks before the inference engine", "lightning", {TRAINER})
def _remove_module_hooks() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    expect("remove_module_hooks(model)" in inspect.getsource(DeepSpeedStrategy._initialize_deepspeed_inference),
           "DeepSpeedStrategy._initialize_deepspeed_inference no longer removes the module hooks")
    module = torch.nn.Linear(2, 2)
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(1))
    _compat.remove_module_hooks(module)
    module(torch.ones(1, 2))
    expect(seen == [], "remove_module_hooks leaves forward pre-hooks")


# Fabric's DeepSpeedStrategy methods the Fabric front end overrides with their body copied or wrapped (lightning 2.6.x).
FABRIC_OVERRIDDEN = {"_setup_distributed": "a24351400d46ed98", "_initialize_engine": "3ce165d771db9b66",
                     "setup_module_and_optimizers": "5d590e4b6e684053", "setup_module": "cd6ad66d058c82ec",
                     "load_checkpoint": "7ff5bd894df281b2", "save_checkpoint": "3cde990985dcf02a"}


def _fabric_override_check(name: str) -> Callable[[], None]:
    def check() -> None:
        """Fabric's method is the one the Fabric front end's override copies or wraps (its source digest; the
        override's arguments are pinned by tests/test_compat.py)."""
        from lightning.fabric.strategies import DeepSpeedStrategy

        theirs = getattr(DeepSpeedStrategy, name)
        expect(source_digest(theirs) == FABRIC_OVERRIDDEN[name],
               f"Fabric changed DeepSpeedStrategy.{name} (source digest {source_digest(theirs)}, written against"
               f" {FABRIC_OVERRIDDEN[name]})")
        if name == "_initialize_engine":
            expect(initialize_keywords(_compat.initialize_training_engine) == initialize_keywords(theirs) | {"mpu"},
                   "Fabric's DeepSpeedStrategy._initialize_engine passes deepspeed.initialize other keywords")
    return check


for _name in sorted(FABRIC_OVERRIDDEN):
    touch_point(f"lightning: Fabric DeepSpeedStrategy.{_name}", "lightning", {FABRIC})(_fabric_override_check(_name))


@touch_point("lightning: Fabric's optimizer step and no_backward_sync", "lightning", {FABRIC})
def _fabric_accumulation() -> None:
    """``optimizer.step()`` reaches DeepSpeed's optimizer, not the engine (the engine is not ``Optimizable``), and
    ``fabric.no_backward_sync`` calls the strategy's ``_backward_sync_control`` with the engine; ``_move_state_into``
    keeps its arguments."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.fabric import Fabric
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.fabric.utilities.load import _move_state_into
    from lightning.fabric.wrappers import _FabricOptimizer

    expect("isinstance(self._strategy.model, Optimizable)" in inspect.getsource(_FabricOptimizer.step),
           "_FabricOptimizer.step decides otherwise whom to step")
    expect(not hasattr(DeepSpeedEngine, "param_groups"), "DeepSpeedEngine now has param_groups (Optimizable)")
    expect("_backward_sync_control.no_backward_sync(forward_module, enabled)" in inspect.getsource(
        Fabric.no_backward_sync), "Fabric.no_backward_sync calls the strategy otherwise")
    expect(_parameters(_BackwardSyncControl.no_backward_sync) == ["self", "module", "enabled"],
           "_BackwardSyncControl.no_backward_sync takes other arguments")
    expect(_parameters(_move_state_into) == ["source", "destination", "keys"], "_move_state_into takes other arguments")


# ================================================================================================ DeepSpeed
@touch_point("deepspeed: DeepSpeedEngine._get_ckpt_name", "deepspeed")
def _checkpoint_name() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    expect(_parameters(DeepSpeedEngine._get_ckpt_name) == [
        "self", "checkpoints_path", "tag", "mp_placeholder", "pp_placeholder"], "_get_ckpt_name takes other arguments")
    expect("self._get_ckpt_name(" in inspect.getsource(DeepSpeedEngine._get_all_ckpt_names),
           "the engine no longer names its model-states files through _get_ckpt_name")


@touch_point("deepspeed: the ZeRO optimizers' state that re-partitioning reads", "deepspeed")
def _zero_optimizer_state() -> None:
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls, module, names in ((DeepSpeedZeroOptimizer, stage_1_and_2, _compat.ZERO12_STATE),
                               (DeepSpeedZeroOptimizer_Stage3, stage3, _compat.ZERO3_STATE)):
        source = inspect.getsource(module)  # the module's file (a class's source costs a parse of it: 10× more)
        expect(f"class {cls.__name__}(" in source, f"{cls.__name__} moved out of {module.__name__}")
        missing = [name for name in names if f"self.{name} =" not in source and f"self.{name}:" not in source]
        expect(not missing, f"{cls.__name__} no longer sets {missing}")
    expect(_parameters(DeepSpeedZeroOptimizer._link_all_hp_params) == ["self"], "_link_all_hp_params changed")
    for name in ("_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups"):
        expect(_parameters(getattr(DeepSpeedZeroOptimizer_Stage3, name)) == ["self"], f"{name} changed")


@touch_point("deepspeed: optimizer._restore_from_bit16_weights after loading", "deepspeed")
def _restore_from_bit16() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    expect("self.optimizer._restore_from_bit16_weights()" in inspect.getsource(DeepSpeedEngine.load_checkpoint),
           "load_checkpoint no longer ends with optimizer._restore_from_bit16_weights()")
    expect(_compat.has_restore_from_bit16(DeepSpeedZeroOptimizer)
           and _compat.has_restore_from_bit16(DeepSpeedZeroOptimizer_Stage3)
           and not _compat.has_restore_from_bit16(DeepSpeedZeRoOffload),
           "which ZeRO optimizers have _restore_from_bit16_weights changed")


@touch_point("deepspeed: ZeRO-3's flat buffer of gradient partitions", "deepspeed")
def _zero3_gradient_buffer() -> None:
    from deepspeed.runtime.zero import stage3

    source = inspect.getsource(stage3)
    expect("self.grad_partitions_flat_buffer: Tensor = torch.zeros(" in source
           and "grad_buffer.copy_(grad_partition" in source,
           "ZeRO-3 no longer keeps gradient partitions in grad_partitions_flat_buffer")


@touch_point("deepspeed: ZeRO-3's parameter attributes (ds_status, ds_numel, ds_grad_is_ready)", "deepspeed")
def _zero3_parameter_attributes() -> None:
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    expect({"AVAILABLE", "NOT_AVAILABLE"} <= set(ZeroParamStatus.__members__), "ZeroParamStatus changed")
    source = inspect.getsource(partition_parameters)
    expect("param.ds_status =" in source and "param.ds_numel =" in source and "param.ds_id =" in source,
           "ZeRO-3 parameters no longer carry ds_status / ds_numel / ds_id")
    for module in (stage3, stage_1_and_2):
        expect("ds_grad_is_ready" in inspect.getsource(module), f"{module.__name__} no longer reads ds_grad_is_ready")


@touch_point("deepspeed: ZeRO-3 external-parameter discovery in a forward (ZeROOrderedDict._in_forward)", "deepspeed")
def _zero3_forward_discovery() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    module = torch.nn.Linear(1, 1)
    ensure_zero_ordered_dict(module)
    expect(isinstance(module._parameters, ZeROOrderedDict) and module._parameters._in_forward is False,
           "ensure_zero_ordered_dict no longer gives a ZeROOrderedDict with _in_forward")
    expect("is_eager_forward = self._parent_module._parameters._in_forward" in inspect.getsource(ZeROOrderedDict),
           "ZeROOrderedDict no longer discovers external parameters by _in_forward")
    expect("module._parameters._in_forward = True" in inspect.getsource(DeepSpeedEngine._forward_prologue),
           "the engine's forward prologue no longer sets _in_forward")


@touch_point("deepspeed: ZeRO-3's trace invalidation and parameter release after the probe", "deepspeed")
def _zero3_trace_restart() -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    for name in ("_invalidate_trace", "is_invalid_trace"):
        expect(_parameters(getattr(PartitionedParameterCoordinator, name)) == ["self"], f"coordinator.{name} changed")
    expect("_clear_trace_structures()" in inspect.getsource(PartitionedParameterCoordinator._invalidate_trace),
           "coordinator._invalidate_trace no longer clears the recorded trace")
    expect("AVAILABLE" in ZeroParamStatus.__members__, "ZeroParamStatus changed")


@touch_point("deepspeed: ZeRO-3 leaf modules (set_z3_leaf_module)", "deepspeed")
def _zero3_leaf_modules() -> None:
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_module, z3_leaf_module

    module = torch.nn.Linear(1, 1)
    set_z3_leaf_module(module, True)
    expect(z3_leaf_module(module), "set_z3_leaf_module no longer marks a leaf")
    set_z3_leaf_module(module, False)
    expect(not z3_leaf_module(module), "set_z3_leaf_module no longer unmarks a leaf")


# ================================================================================================ litdata
@touch_point("litdata: the distributed env a StreamingDataset splits by, its loader's collate wrapper", "litdata")
def _litdata_distributed_env() -> None:
    from litdata.streaming.dataloader import StreamingDataLoader, StreamingDataLoaderCollateFn
    from litdata.streaming.dataset import StreamingDataset
    from litdata.utilities.env import _DistributedEnv

    expect(_parameters(_DistributedEnv.__init__)[:4] == ["self", "world_size", "global_rank", "num_nodes"],
           "litdata's _DistributedEnv(world_size, global_rank, num_nodes) changed")
    env = _DistributedEnv(world_size=4, global_rank=3, num_nodes=2)
    expect((env.world_size, env.global_rank, env.num_nodes) == (4, 3, 2), "_DistributedEnv's fields changed")
    expect(callable(getattr(_DistributedEnv, "detect", None)), "_DistributedEnv.detect is gone")
    expect("self.distributed_env = _DistributedEnv.detect()" in inspect.getsource(StreamingDataset.__init__),
           "StreamingDataset no longer keeps its split in distributed_env")
    expect(_parameters(StreamingDataLoaderCollateFn.__init__)[:2] == ["self", "collate_fn"],
           "StreamingDataLoaderCollateFn(collate_fn) changed")
    expect(callable(getattr(StreamingDataLoader, "load_state_dict", None)), "StreamingDataLoader.load_state_dict")


# ================================================================================================ torch
TORCH_OP_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu":
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float dropout_p=0.,"
        " bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key,"
        " Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None,"
        " float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
    "_scaled_dot_product_efficient_attention":
        "aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias,"
        " bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *, float? scale=None) -> (Tensor output,"
        " Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)",
    "_scaled_dot_product_efficient_attention_backward":
        "aten::_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key,"
        " Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset,"
        " float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *, float? scale=None) -> (Tensor, Tensor,"
        " Tensor, Tensor)",
}


@touch_point("torch: the private attention ops of the ring kernels (schemas)", "torch")
def _attention_op_schemas() -> None:
    for op, schema in TORCH_OP_SCHEMAS.items():
        expect(str(getattr(torch.ops.aten, op).default._schema) == schema, f"torch.ops.aten.{op} changed its schema")


@touch_point("torch: the CPU flash-attention op's output, log-sum-exp and backward", "torch")
def _cpu_flash_attention() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
               for _ in range(3))
    scale = 0.5
    for causal in (False, True):
        out, lse = _compat.cpu_flash_attention(q, k, v, causal, None, scale)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        scores = (q @ k.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        expect(torch.allclose(out, reference), "the CPU flash-attention op's output is not SDPA's")
        expect(torch.allclose(lse, scores.logsumexp(-1)), "the CPU flash-attention op's second output is not the"
                                                          " log-sum-exp of the scaled scores")
        dout = torch.randn(out.shape, dtype=out.dtype, generator=generator)
        grads = torch.autograd.grad(reference, (q, k, v), dout)
        ours = _compat.cpu_flash_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                                    lse.detach(), causal, None, scale)
        expect(all(torch.allclose(a, b) for a, b in zip(ours, grads)),
               "the CPU flash-attention backward op's gradients are not SDPA's")


@touch_point("torch: nn.Module's forward (pre-)hook registries", "torch")
def _hook_registries() -> None:
    module = torch.nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, args: None)
    post = module.register_forward_hook(lambda m, args, out: None)
    expect(_compat.hook_is_registered(module, pre) and _compat.hook_is_registered(module, post),
           "a registered hook is not found in the module's registries")
    pre.remove()
    expect(not _compat.hook_is_registered(module, pre), "a removed hook is still found")


# ================================================================================================ transformers
@touch_point("transformers: config._attn_implementation reaches the sub-configs", "transformers")
def _attention_implementation() -> None:
    from lightning_ulysses.families.reference import composite_config

    config = composite_config()
    for name in ("eager", "sdpa"):
        _compat.set_attention_implementation(config, name)
        expect(_compat.attention_implementation(config) == name
               and _compat.attention_implementation(config.text_config) == name,
               "setting config._attn_implementation no longer reaches the text config")


@touch_point("transformers: the ZeRO-3 switch (HfDeepSpeedConfig's weak reference)", "transformers")
def _deepspeed_switch() -> None:
    from transformers.integrations import is_deepspeed_zero3_enabled

    before = is_deepspeed_zero3_enabled()
    with _compat.transformers_deepspeed_config({"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
        expect(is_deepspeed_zero3_enabled(), "HfDeepSpeedConfig no longer turns transformers' ZeRO-3 mode on")
    expect(is_deepspeed_zero3_enabled() == before, "transformers' ZeRO-3 mode is not put back")


@touch_point("transformers: PreTrainedModel._from_config", "transformers")
def _model_from_config() -> None:
    from lightning_ulysses.families.reference import reference_decoder

    decoder_class, config = reference_decoder()
    model = _compat.model_from_config(decoder_class, config, attn_implementation="sdpa", dtype=torch.float32)
    expect(type(model) is decoder_class and _compat.attention_implementation(model.config) == "sdpa",
           "_from_config no longer builds the class with the given attention implementation")


def decoders_packing_from_four_rows() -> set[str]:
    """The installed transformers' modeling modules whose decoder takes text positions from ``[4, B, S]`` positions
    only (``position_ids.shape[0] == 4``)."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    return {path.parent.name for path in models.glob("*/modeling_*.py")
            if "position_ids.shape[0] == 4" in path.read_text(encoding="utf-8")}


@touch_point("transformers: the decoders that pack only from [4, B, S] positions", "transformers")
def _packing_from_four_rows() -> None:
    """No decoder the packing rule does not know (one that left the table is no risk: its table entry only refuses)."""
    from lightning_ulysses.families.multimodal_positions import PACKING_FROM_FOUR_ROWS

    unknown = sorted(decoders_packing_from_four_rows() - PACKING_FROM_FOUR_ROWS)
    expect(not unknown, f"decoders that read packed samples only from [4, B, S] positions the packing rule does"
                        f" not know: {unknown}")


PACKAGES = ("torch", "lightning", "deepspeed", "transformers")

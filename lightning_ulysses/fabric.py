"""``UlyssesDeepSpeedStrategy`` for Lightning Fabric: the same sequence parallelism as the Trainer's strategy, for
Fabric scripts (and LitGPT, which is written on Fabric).

    fabric = L.Fabric(strategy=UlyssesDeepSpeedStrategy(sp_size=4), devices=8)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)     # attention (and mixers) switched to Ulysses
    loader = fabric.setup_dataloaders(loader)             # every rank gets its shard of each sequence
    for batch in loader:
        loss = model(**batch).loss                        # or strategy.cross_entropy(logits, batch["shift_labels"])
        fabric.backward(loss)                             # one device's gradients, at ZeRO 0-3
        optimizer.step(); optimizer.zero_grad()

Glue only: the layout, the model preparation, the data sharding, the step runner, the loss and the checkpoints are
the ones the Trainer's strategy uses (:mod:`lightning_ulysses.front_end` holds what both front ends share). What
only Fabric needs: steps begin at the forward pass of the set-up model, since Fabric has no step hooks
(:mod:`lightning_ulysses.training.forward_steps`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module, ModuleDict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ulysses import _compat, front_end
from lightning_ulysses.checkpoint import saving
from lightning_ulysses.config import SequenceParallelConfig
from lightning_ulysses.data.loaders import ShardInfoQueue
from lightning_ulysses.data.setup import prepare_dataloader
from lightning_ulysses.front_end import SequenceParallelFrontEnd
from lightning_ulysses.models import memory
from lightning_ulysses.parallel.attention import ModuleSelector
from lightning_ulysses.training.forward_steps import ForwardSteps, RecordedBatches
from lightning_ulysses.training.gradient_factor import verify_deepspeed_divisor


class AccumulationWindow(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=is_accumulating)`` for DeepSpeed: the backward passes inside it
    accumulate gradients without DeepSpeed's reduction (not an accumulation boundary); the first one outside it ends
    the window, and ``optimizer.step()`` follows. Fabric's own DeepSpeed strategy has no such control, so there every
    backward pass is a boundary (at ZeRO 1-2 the gradients of the window's earlier passes are then lost)."""

    @contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        module.set_gradient_accumulation_boundary(False)  # `module`: the DeepSpeed engine Fabric set up
        try:
            yield
        finally:
            module.set_gradient_accumulation_boundary(True)


class UlyssesDeepSpeedStrategy(SequenceParallelFrontEnd, DeepSpeedStrategy):
    """Lightning Fabric's DeepSpeed strategy with Ulysses sequence parallelism: each sequence is split across
    ``sp_size`` ranks, attention runs over the whole sequence on ``heads / sp_size`` heads, and the training is the
    one a single device would run (same losses, same gradients, at every ZeRO stage).

    What it does to a Fabric script:

    * ``fabric.launch()`` / torchrun / SLURM: builds the ``("dp", "ring", "ulysses")`` device mesh
      (``strategy.device_mesh``) and hands DeepSpeed the SP groups, so ZeRO's batch arithmetic uses dp;
    * ``fabric.setup(model, optimizer)``: finds the Hugging Face models, LitGPT ``GPT`` models and declared attention
      cores in ``model`` and switches them to their sequence-parallel form (refusing what is not supported, before
      any compute); one model per strategy;
    * ``fabric.setup_dataloaders(loader)``: a ``DistributedSampler`` over the dp replicas (all ranks of an SP group
      read the same samples) and a collate step that cuts each batch into this rank's shard (``input_ids``,
      ``labels``, ``position_ids`` of the global positions, ``shift_labels`` built before the cut); batches must be
      dicts with ``input_ids``;
    * a forward pass of the set-up model on a batch from those loaders runs sequence-parallel; the SP peers check
      that they hold the same batch, and before the first step the model-form check runs the model whole and
      sharded on a short probe;
    * ``fabric.backward(loss)``: the loss of a Hugging Face model (``model(**batch).loss``) or of
      :meth:`cross_entropy` is the full batch's mean; the gradients are one device's, and the SP peers check that
      they back-propagated the same loss before the optimizer step;
    * ``fabric.save`` / ``fabric.load``: DeepSpeed's checkpoint directory with a completion marker and file digests;
      a checkpoint saved on another number of ranks, SP split or ZeRO stage (1-3) is re-partitioned on load.

    Gradient accumulation as Fabric documents it: ``with fabric.no_backward_sync(model, enabled=is_accumulating):``
    around the forward and ``fabric.backward(loss / k)``, ``optimizer.step()`` after the window's last micro-batch.
    (DeepSpeed's ``gradient_accumulation_steps`` config is refused: Fabric calls DeepSpeed's optimizer step directly
    after every micro-batch. Two backward passes before a step without ``no_backward_sync`` are refused at ZeRO 0-2,
    where DeepSpeed would keep only the last one's gradients; ZeRO-3 accumulates them.)

    Args: as the Trainer's :class:`lightning_ulysses.UlyssesDeepSpeedStrategy` (``sp_size``, ``ring_size``,
    ``sdpa_per_document``, ``attention_modules``, ``tiled_mlp``, ``tiled_loss``, ``offload_checkpoints``,
    ``offload_attention``,
    ``check_sp_agreement``, ``verify_checkpoints``, ``check_model_form``, ``allow_untested_versions``,
    ``memory_budget``, ``preflight``, ``sequence_length``; with ``sp_size="auto"`` the size is chosen at
    ``fabric.setup(model, ...)``, so set up the model before the dataloaders), and every
    argument of Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy` (``stage``, ``config``, ...) as
    keywords.
    """

    _front_end_name = "fabric"  # the drift check runs Fabric's touch points

    def __init__(
        self,
        sp_size: Optional[Union[int, str]] = None,
        sdpa_per_document: bool = False,
        attention_modules: Optional[Sequence[ModuleSelector]] = None,
        tiled_mlp: memory.TileSetting = 0,
        tiled_loss: memory.TileSetting = 0,
        offload_checkpoints: bool = False,
        offload_attention: Union[bool, int, str] = False,
        check_sp_agreement: bool = True,
        verify_checkpoints: bool = True,
        ring_size: int = 1,
        check_model_form: bool = True,
        allow_untested_versions: bool = False,
        memory_budget: Optional[int] = None,
        preflight: str = "stop",
        sequence_length: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        # every value checked before anything is built; per-token outputs are the user's to gather under Fabric
        settings = SequenceParallelConfig.from_arguments({**locals(), "gather_predictions": False})
        super().__init__(**kwargs)
        self._init_sequence_parallel(settings)
        self._steps: Optional[ForwardSteps] = None
        self._module: Optional[Module] = None  # the model set up (one per strategy)
        self._backward_sync_control = AccumulationWindow()
        self._window_ends_since_step = 0  # backward passes at an accumulation boundary since the last optimizer step

    # ----------------------------------------------------------------------------------------------- processes
    @override
    def setup_environment(self) -> None:
        # Fabric's DeepSpeedStrategy refuses anything but CUDA; the DDP set-up underneath works for CPU/gloo too.
        self._set_up_sequence_parallel(lambda: DDPStrategy.setup_environment(self))
        if self._steps is None and self._runner is not None:  # sp_size="auto": at fabric.setup(model)
            self._steps = ForwardSteps(self.runner)

    @override
    def _setup_distributed(self) -> None:
        if self.root_device.type == "cpu":
            # CPU devices carry no index, so the parent's CUDA device-index check does not apply.
            reset_seed()
            self._set_world_ranks()
            self._init_deepspeed_distributed()
            _compat.format_fabric_deepspeed_config(self)
            return
        super()._setup_distributed()

    # ----------------------------------------------------------------------------------------------- model
    @override
    def module_sharded_context(self) -> Any:
        """Fabric's ``deepspeed.zero.Init`` (ZeRO-3) around ``fabric.init_module()``, with transformers told that
        ZeRO-3 is active and ``torch.nn.init`` working on partitioned parameters (as the Trainer's strategy)."""
        @contextmanager
        def sharded() -> Iterator[None]:
            with super(UlyssesDeepSpeedStrategy, self).module_sharded_context(), \
                    front_end.zero3_model_building(self.config, self.zero_stage_3):
                yield

        return sharded()

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
                                    ) -> tuple[Any, list[Optimizer], Any]:
        """Prepare the models in ``module`` (before any compute), build DeepSpeed's engine with the SP groups, and check
        once that DeepSpeed averages gradients the way the strategy's gradient factors assume."""
        if len(optimizers) != 1:
            return super().setup_module_and_optimizers(module, optimizers, scheduler)  # Fabric's error
        self._prepare(module)
        engine, optimizer, scheduler = self._initialize_engine(module, optimizers[0], scheduler)
        self._deepspeed_engine = engine
        self._set_deepspeed_activation_checkpointing()
        self._attach_steps(engine)
        verify_deepspeed_divisor(self.runner.context.gradients, self.config, self.layout.deepspeed_mpu(),
                                 self.root_device, _compat.device_rank(self))
        return engine, [optimizer], scheduler

    @override
    def setup_module(self, module: Module) -> Any:
        """A model for evaluation only (no optimizer), prepared the same way. Its engine takes only the precision and
        ZeRO-3's settings from the config (ZeRO 1-2 partition optimizer state, and DeepSpeed refuses them without an
        optimizer; Fabric's own strategy fails there), as the Trainer's strategy builds its evaluation engine."""
        self._prepare(module)
        engine = _compat.initialize_inference_engine(self, module, self.layout.deepspeed_mpu(), None)
        self._deepspeed_engine = engine
        self._attach_steps(engine)
        return engine

    def _prepare(self, module: Module) -> None:
        if self._module is not None:
            raise ValueError(
                "UlyssesDeepSpeedStrategy (Fabric) sets up one model per strategy, and"
                f" {type(self._module).__name__} is set up already: DeepSpeed trains one engine, and every forward"
                " pass of the set-up model is a sequence-parallel step. Put every model of the step into one module"
                " (e.g. a wrapper holding the policy and a frozen reference) and set that up."
            )
        accumulation = int(self.config.get("gradient_accumulation_steps", 1))
        if accumulation != 1:
            raise ValueError(accumulation_config_error(accumulation))
        if self._layout is None:  # sp_size="auto": chosen now that the model is known
            self._choose_sp_size(module)
            self._steps = ForwardSteps(self.runner)
        runner = self.runner
        # DeepSpeed's accumulation count is 1: the loss is divided by the window only where the script divides it.
        front_end.complete_gradient_factors(runner, self.config, self.layout, 1, self.zero_stage_3,
                                            tiles_follow_length=self.memory_features.auto)
        # The preparation looks for models below the root it is given (a LightningModule holds its models): the
        # module Fabric sets up is often the model itself, so it goes in as the one child of a holder.
        holder = ModuleDict({"model": module})
        self._models.prepare(holder, runner.context, self._patches, attention_modules=self.attention_modules,
                             ring_size=self.ring_size, device_type=self.root_device.type,
                             memory_features=self.memory_features, fitting=False)
        runner.begin_stage()
        self._module = module

    def _attach_steps(self, engine: Module) -> None:
        steps = self._steps
        assert steps is not None
        handles = []
        self._patches.apply(
            f"{type(engine).__name__}: steps begin at its forward passes",
            lambda: handles.extend([
                engine.register_forward_pre_hook(steps.before_forward, with_kwargs=True, prepend=True),
                engine.register_forward_hook(steps.after_forward, always_call=True)]),
            lambda: [handle.remove() for handle in handles])

    @override
    def _initialize_engine(self, model: Module, optimizer: Optional[Optimizer] = None, scheduler: Optional[Any] = None
                           ) -> tuple[Any, Any, Any]:
        return _compat.initialize_training_engine(self, model, optimizer, scheduler, self.layout.deepspeed_mpu())

    @property
    def deepspeed_engine(self) -> Any:
        """The DeepSpeed engine of the set-up model."""
        return self._deepspeed_engine

    # ----------------------------------------------------------------------------------------------- steps
    @override
    def backward(self, tensor: torch.Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``tensor`` with the whole-loss gradient factor, then check, before any weight changes, that
        the SP peers back-propagated the same loss (:meth:`StepRunner.backward`)."""
        if self._runner is None or self._module is None:
            return super().backward(tensor, module, *args, **kwargs)
        engine = self._deepspeed_engine
        if engine is not None and engine.is_gradient_accumulation_boundary():
            if self._window_ends_since_step and not self.zero_stage_3:
                raise ValueError(second_backward_error(self.config))
            self._window_ends_since_step += 1
        self._runner.backward(tensor, lambda scaled: super(UlyssesDeepSpeedStrategy, self).backward(
            scaled, module, *args, **kwargs), self.zero_stage_3, where="fabric.backward")
        return None

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """DeepSpeed's step; at ZeRO-3, when it ends an accumulation window, the gradient partitions are then cleared
        (a parameter the next window does not use is not moved by this window's gradient again)."""
        engine = self._deepspeed_engine
        result = super().optimizer_step(optimizer, **kwargs)
        self._window_ends_since_step = 0
        if self.zero_stage_3 and engine is not None and engine.optimizer is not None:
            _compat.clear_zero3_gradient_partitions(engine.optimizer)
        return result

    # ----------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The sequence-sharding collate step and the strategy's loader layers; every batch handed out is recorded
        for the forward pass that uses it."""
        runner, steps = self.runner, self._steps
        assert steps is not None
        queue = ShardInfoQueue()
        end_of_data_check = runner.agreement.verify_end_of_data if runner.agreement is not None else None
        prepared = prepare_dataloader(dataloader, self.layout, {"train": queue}, 1, end_of_data_check, None,
                                      self._models.pad_token_id(), self._patches)
        return RecordedBatches(prepared, queue, steps)

    # ----------------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """DeepSpeed's checkpoint directory (every rank writes its shard), marked complete only once every rank has
        written, with the layout, the Hugging Face models and the files' digests recorded
        (:mod:`lightning_ulysses.checkpoint.markers`)."""
        if storage_options is not None or filter is not None:
            return super().save_checkpoint(path, state, storage_options, filter)  # Fabric's TypeError
        saving.save(self, state, path,
                    lambda content, where: super(UlyssesDeepSpeedStrategy, self).save_checkpoint(where, content),
                    module=self._module)
        return None

    @override
    def load_checkpoint(self, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint validated first (complete, intact, a loadable layout), loaded by DeepSpeed on the same layout
        or re-partitioned on another number of ranks, SP split or ZeRO stage; the state's objects restored in place
        and the rest of the saved state returned, as Fabric's ``load``."""
        engine = self._deepspeed_engine
        if not isinstance(state, dict) or not state or engine is None or (self.load_full_weights
                                                                           and self.zero_stage_3):
            return super().load_checkpoint(path, state, strict, weights_only)  # Fabric's paths and errors
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        resuming = any(isinstance(item, (Optimizer, DeepSpeedOptimizer)) for item in state.values())
        loaded_by_fabric = []

        def load_with_fabric() -> dict[str, Any]:
            loaded_by_fabric.append(True)
            return super(UlyssesDeepSpeedStrategy, self).load_checkpoint(path, state, strict, weights_only)

        client_state = saving.load(self, path, load_with_fabric, resuming=resuming, strict=strict)
        if not loaded_by_fabric:  # re-partitioned: the user's objects get their state as Fabric gives it
            keys = set(client_state) & set(state) - {"optimizer", "lr_scheduler"}
            _compat.move_state_into(client_state, state, keys)
        return client_state

    # ----------------------------------------------------------------------------------------------- lifecycle
    @override
    def teardown(self) -> None:
        self._patches.close()  # every model, loader and library function back as it was, last change first
        if self._runner is not None:
            self._form_checks_before += self._runner.form_checks_run
        self._runner, self._steps, self._module = None, None, None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, stage in (("ulysses_deepspeed", 2), ("ulysses_deepspeed_stage_1", 1),
                            ("ulysses_deepspeed_stage_2", 2), ("ulysses_deepspeed_stage_3", 3)):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"Ulysses SP + DeepSpeed ZeRO {stage} (Fabric)",
                                           stage=stage)


def accumulation_config_error(steps: int) -> str:
    return (
        f"UlyssesDeepSpeedStrategy (Fabric): the DeepSpeed config sets gradient_accumulation_steps={steps}, but Fabric"
        " calls DeepSpeed's optimizer step directly after every `optimizer.step()`, so DeepSpeed's own window would"
        " never be kept. Leave it at 1 and accumulate as Fabric documents it: `with fabric.no_backward_sync(model,"
        " enabled=is_accumulating): fabric.backward(loss / k)`, and `optimizer.step()` after the window's last"
        " micro-batch."
    )


def second_backward_error(config: dict) -> str:
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    return (
        "UlyssesDeepSpeedStrategy (Fabric): a second `fabric.backward` before `optimizer.step()` outside"
        f" `fabric.no_backward_sync(...)`: at ZeRO stage {stage} DeepSpeed reduces the gradients at every backward"
        " pass that ends an accumulation window and keeps only the last one's, so the earlier micro-batches would be"
        " silently dropped. Wrap the window's other micro-batches in `with fabric.no_backward_sync(model,"
        " enabled=is_accumulating):` (Fabric's way to accumulate), or call `optimizer.step()` after every backward."
    )


UlyssesDeepSpeedStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["UlyssesDeepSpeedStrategy"]

"""``UlyssesDeepSpeedStrategy``: Lightning's DeepSpeed strategy plus Ulysses sequence parallelism.

Glue only, in one file: every Lightning hook the strategy overrides is here, marked ``@override``, and hands its work
to the object that owns it:

* the DP×SP layout: :class:`~lightning_ulysses.parallel.layout.SequenceParallelLayout`;
* the models, found, validated and prepared per stage: :class:`~lightning_ulysses.models.preparation.PreparedModels`;
* every step (shard facts, checks, the gradient factor, the step API):
  :class:`~lightning_ulysses.training.step_runner.StepRunner`;
* the DataLoaders: :func:`~lightning_ulysses.data.setup.prepare_dataloader`;
* checkpoints: :mod:`~lightning_ulysses.checkpoint.saving`;
* every change to objects the strategy does not own, undone in teardown: :class:`~lightning_ulysses.patches.PatchStack`;
* Lightning's private methods the strategy overrides: :mod:`~lightning_ulysses._compat`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional, Sequence, Union

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import override

from lightning_ulysses import _compat, front_end
from lightning_ulysses.checkpoint import saving
from lightning_ulysses.config import SequenceParallelConfig
from lightning_ulysses.data.setup import prepare_dataloader
from lightning_ulysses.data.sharding import automatic_batching_off_error
from lightning_ulysses.front_end import SequenceParallelFrontEnd
from lightning_ulysses.models import memory
from lightning_ulysses.models.refusals import (refuse_compile_wrapper_at_zero3, refuse_tuning_callbacks,
                                               refuse_weight_averaging_on_partitioned_parameters)
from lightning_ulysses.parallel.attention import ModuleSelector
from lightning_ulysses.training.gradient_factor import verify_deepspeed_divisor


class UlyssesDeepSpeedStrategy(SequenceParallelFrontEnd, DeepSpeedStrategy):
    """DeepSpeed ZeRO training with Ulysses sequence parallelism (DeepSpeed Ulysses / ALST) for long sequences.

    Each sequence is split across ``sp_size`` ranks: every rank holds ``S / sp_size`` tokens with all heads, and
    around attention an all-to-all swaps to all ``S`` tokens with ``heads / sp_size`` heads, attention runs locally,
    and a second all-to-all swaps back. Activation memory per rank falls by ``sp_size``; the training is numerically
    the one a single device would run (same losses, same gradients, at every ZeRO stage).

    What the strategy does, with no change to the LightningModule:

    * builds a :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "ring", "ulysses")`` and
      ``"sp"`` = ``ring × ulysses`` flattened (SP innermost so an SP group stays inside a node), reachable as
      ``strategy.device_mesh`` and ``LightningModule.device_mesh`` (the ``"sp"`` mesh: ``strategy.layout.sp_mesh``);
    * hands DeepSpeed the SP groups, so ZeRO's batch arithmetic uses dp while gradients reduce over all ranks;
    * switches every Hugging Face ``PreTrainedModel`` in the LightningModule to Ulysses attention (``sdpa``,
      ``flash_attention_2/3`` or ``flex_attention``) and to a loss whose value is the full-sequence loss;
    * gives the train/val/test/predict samplers ``num_replicas=dp`` and wraps each DataLoader's collate function
      so that every rank receives its sequence shard (see :func:`lightning_ulysses.data.sharding.shard_batch`).

    Runs on CUDA (nccl) and on CPU (gloo, DeepSpeed's CPU accelerator).

    Args:
        sp_size: Ranks per sequence-parallel group. Must divide the world size (``num_nodes × devices``) and, with
            ``ring_size``, leave at least one attention head per Ulysses rank (``sp_size / ring_size <= heads``;
            uneven head splits work, the busiest rank sets the pace). ``None``: the number of devices per node (SP
            inside each node, DP across nodes). ``"auto"``: chosen from the memory plan of the model (built by then:
            after ``configure_model``, before DeepSpeed's engine) for rows of ``sequence_length`` tokens: the
            quickest size whose planned per-rank peak fits ``memory_budget`` (default: the smallest free device
            memory over the ranks; required on CPU) with the run's ZeRO stage, precision and switches; logged on rank
            zero and kept as ``strategy.auto_choice``; none fits: every rank stops naming settings that would
            (docs/planning.md). One Hugging Face model, ``ring_size=1``; ``LightningModule.device_mesh`` exists only
            from then on.
        sequence_length: Tokens per row the run trains on, for ``sp_size="auto"`` (ignored otherwise).
        sdpa_per_document: With ``attn_implementation="sdpa"``, rows that pack several documents run attention
            once per document (exact, no ``[S, S]`` mask; a Python loop, slow with many short documents). Off: such
            batches raise, since plain SDPA would let documents attend to each other. ``flash_attention_2/3``
            (varlen) and ``flex_attention`` (document mask) always keep documents apart.
        attention_modules: For models that are not Hugging Face ``PreTrainedModel``s: which modules of the
            LightningModule are attention cores — classes, ``fnmatch`` name patterns (``"blocks.*.attn.core"``), or
            none (modules with ``ulysses_attention_core = True``, e.g. :class:`lightning_ulysses.UlyssesAttention`,
            are always wrapped). A core's ``forward(q, k, v, **kw)`` takes ``[B, H, S, D]`` and returns
            ``[B, H, S, D]``; after wrapping it receives this rank's shards and runs on the full sequence.
        tiled_mlp: ALST tiled MLP: run each decoder layer's MLP on this many sequence tiles, recomputed tile by tile
            in backward (0: off), or ``"auto"``: one tile per ``hidden_size`` tokens of the shard (ALST's rule).
            Use when the MLP intermediate (``s × intermediate_size``) dominates memory.
        tiled_loss: ALST tiled logits + loss: LM head and cross-entropy on this many sequence chunks under
            checkpointing, so the ``s × vocab`` logits never exist whole (0: off; ``model(**batch).logits`` is then
            ``None`` when labels are given), or ``"auto"``: chunks of at most 2**24 logits (64 MiB in fp32). Use
            with large vocabularies. With ``"auto"`` under ZeRO-3 and several replicas, the ranks agree on the
            step's longest shard by one scalar all-reduce per step (equal tile counts keep ZeRO-3's gathers equal).
        offload_checkpoints: checkpoint every decoder layer and keep the checkpoints in CPU memory until backward.
            Use when the saved layer activations dominate; costs a recompute and host-device copies.
        offload_attention: Ulysses-Offload: after the all-to-all, attention runs over chunks of the gathered
            sequence (``True``/``"auto"``: 16384 positions per chunk, or a number of positions), exactly (the
            chunks' results merged by their log-sum-exps), and on CUDA the chunks backward needs wait in pinned host
            memory, copied on a side stream, instead of on the device. Causal attention, sliding windows, packed
            documents, GQA/MQA; not with ring attention, sinks, chunked (Llama 4) attention or image blocks (refused
            before compute). On CPU there is no host to move to: the chunking runs, nothing moves.
        gather_predictions: ``predict_step`` outputs that are per-token (``[B, s, ...]``) are gathered to the full
            ``[B, S, ...]`` on every rank of the SP group. ``False`` keeps each rank's shard (saves memory).
        check_sp_agreement: before every step, the ranks of each SP group verify that they hold the same full batch
            (a digest of the full batch taken in the collate step, compared with one all-reduce of 6 integers over
            the SP group), and a loader that runs out of batches on one peer but not on another stops all of them;
            after every backward pass, before the optimizer step, they verify that they back-propagated the same
            loss through the same use of the strategy's SP losses (one all-reduce of 10 numbers; catches losses
            averaged over a shard and hand-made cross-rank weightings), that the loss is finite, and that its
            autograd graph reaches the model's sharded computation only through SP reductions (a walk of the nodes
            between the loss and the reductions before backward: catches per-row sums over a shard, even where
            their value agrees). A mismatch raises on every rank. Turn off
            only if your peers provably read the same data and your loss is the same on every rank.
        verify_checkpoints: record every checkpoint file's SHA-256 in the completion marker when saving (each rank
            hashes a share of the files) and check them before resuming or evaluating from a checkpoint; a file
            whose bytes changed is refused. ``False`` skips the hashing on both sides (sizes are still checked).
        check_model_form: before the first step of every Trainer stage (fit, validate, test, predict), run the
            model on a short probe whole and sharded on every rank and stop, before any weight changes, if its output
            depends on which shard a rank holds (a model that computes positions, a RoPE frequency choice or a window
            from its shard as if it were the whole sequence; see :mod:`lightning_ulysses.models.form_check`). Two
            forward passes of a few tokens per stage. ``False`` skips it.
        ring_size: Hybrid Ulysses × ring sequence parallelism (USP): the SP group is ``ring_size`` ring groups of
            ``sp_size / ring_size`` Ulysses ranks (consecutive ranks, so a Ulysses group stays inside a node).
            Attention exchanges heads over the Ulysses ranks, then attends across the ring groups (key/value blocks
            passed around the ring point to point, load-balanced zigzag sequence layout). Lifts the head limit: only
            ``sp_size / ring_size`` must fit the heads. 1 (default): Ulysses only. Any attention implementation
            (the ring runs its own block kernels); packed documents are kept apart.
        allow_untested_versions: when torch, Lightning, DeepSpeed or transformers is installed at a version other
            than the tested one (``lightning_ulysses.drift.tested_versions``, the versions of the project's
            ``requirements/lock.txt``), the strategy checks the private APIs it relies on in those libraries once
            per process before the first step: all unchanged gives one warning line and the run goes on; any
            changed stops every rank before a weight changes, naming each. ``True`` (or the environment variable
            ``LIGHTNING_ULYSSES_ALLOW_UNTESTED=1``) turns that stop into a warning: at your own risk.
        memory_budget: bytes per rank the pre-flight check compares the first training step's planned peak with
            (default: on CUDA the device's free memory plus what torch holds; on CPU no check).
        preflight: ``"stop"`` (default): before the first training step computes anything, a step planned above the
            budget (:mod:`lightning_ulysses.plan`) stops every rank with the plan and the changes that would fit;
            ``"warn"``: warns instead; ``"off"``. It runs for one Hugging Face causal LM without the memory switches
            or activation checkpointing (what the plan counts; docs/planning.md).
        **kwargs: Every argument of :class:`~lightning.pytorch.strategies.DeepSpeedStrategy` (``stage``,
            ``offload_optimizer``, ``config``, ...).
    """

    strategy_name = "ulysses_deepspeed"

    def __init__(
        self,
        sp_size: Optional[Union[int, str]] = None,
        sdpa_per_document: bool = False,
        gather_predictions: bool = True,
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
        settings = SequenceParallelConfig.from_arguments(locals())  # every value checked before anything is built
        super().__init__(**kwargs)
        self._init_sequence_parallel(settings)

    @override
    def setup_environment(self) -> None:
        # Lightning's DeepSpeedStrategy refuses anything but CUDA; the DDP setup underneath works for CPU/gloo too.
        self._set_up_sequence_parallel(lambda: DDPStrategy.setup_environment(self))
        if self.lightning_module is not None and self._layout is not None:  # sp_size="auto": in init_deepspeed
            _compat.set_device_mesh(self.lightning_module, self._layout.mesh)

    @override
    def setup_distributed(self) -> None:
        if self.root_device.type == "cpu":
            # CPU devices carry no index, so the parent's CUDA device-index check does not apply.
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
            return
        super().setup_distributed()

    # ----------------------------------------------------------------------------------------------- model
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning's ``deepspeed.zero.Init`` (ZeRO-3: parameters partitioned as they are created) around
        ``configure_model``, with transformers told that ZeRO-3 is active while the block runs, so that
        ``from_pretrained`` / ``from_config`` there load and initialise partitioned weights correctly, and with
        ``torch.nn.init`` working on partitioned parameters (PEFT initialises LoRA layers after building them)."""
        with super().model_sharded_context(), front_end.zero3_model_building(self.config, self.zero_stage_3):
            yield

    @override
    def init_deepspeed(self) -> None:
        """Prepare the models (before any compute), build DeepSpeed's engine, and when training check once that
        DeepSpeed averages gradients the way the strategy's gradient factors assume."""
        assert self.lightning_module is not None and isinstance(self.config, dict)
        if self._layout is None:  # sp_size="auto": chosen now that the model is built, before DeepSpeed's engine
            self._choose_sp_size(self.lightning_module)
            _compat.set_device_mesh(self.lightning_module, self.layout.mesh)
        runner = self.runner
        # Lightning divides the loss by the accumulation count, and DeepSpeed once more.
        accumulation = int(self.config.get("gradient_accumulation_steps", 1))
        front_end.complete_gradient_factors(runner, self.config, self.layout, accumulation, self.zero_stage_3,
                                            tiles_follow_length=self.memory_features.auto)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        refuse_tuning_callbacks(self.lightning_module.trainer.callbacks)
        refuse_weight_averaging_on_partitioned_parameters(self.lightning_module.trainer.callbacks,
                                                          self.lightning_module, self.config)
        refuse_compile_wrapper_at_zero3(self.lightning_module, self.config)
        self._models.prepare(self.lightning_module, runner.context, self._patches,
                             attention_modules=self.attention_modules, ring_size=self.ring_size,
                             device_type=self.root_device.type, memory_features=self.memory_features,
                             fitting=fitting)
        runner.begin_stage()
        super().init_deepspeed()
        if fitting:
            verify_deepspeed_divisor(runner.context.gradients, self.config, self.layout.deepspeed_mpu(),
                                     self.root_device, _compat.device_rank(self))

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optional[Optimizer],
        lr_scheduler: Optional[Union[LRScheduler, ReduceLROnPlateau]] = None,
    ) -> tuple[Any, Optimizer]:
        engine, deepspeed_optimizer, _ = _compat.initialize_training_engine(self, model, optimizer, lr_scheduler,
                                                                           self.layout.deepspeed_mpu())
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        # Lightning removes every module hook first: the strategy's own pre-hooks are installed again after it.
        self.model = _compat.initialize_inference_engine(
            self, model, self.layout.deepspeed_mpu(), lambda: self._models.reinstall_hooks(self.runner.context))

    # ----------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        trainer = _compat.attached_trainer(self.lightning_module)
        if trainer is not None and self.lightning_module.automatic_optimization:
            self.runner.follow_accumulation(self.deepspeed_engine, lambda: _compat.window_continues(trainer))
        with self.runner.step("train", batch):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.runner.step("validate", args[0] if args else kwargs.get("batch")):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.runner.step("test", args[0] if args else kwargs.get("batch")):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        local_shape = tuple(batch["input_ids"].shape[:2]) if isinstance(batch, dict) and "input_ids" in batch else None
        with self.runner.step("predict", batch):
            output = super().predict_step(*args, **kwargs)
        return self.runner.gather_prediction(output, local_shape)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """Back-propagate the step's loss with the whole-loss gradient factor, then check, before any weight changes,
        that the SP peers back-propagated the same loss (:meth:`StepRunner.backward`)."""
        if self._runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        step = self.lightning_module.trainer.global_step
        self._runner.backward(closure_loss, lambda scaled: super(UlyssesDeepSpeedStrategy, self).backward(
            scaled, optimizer, *args, **kwargs), self.zero_stage_3, where=f"training step at global step {step}")
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's DeepSpeed optimizer step; at ZeRO-3 the gradient partitions are then cleared, so that a
        parameter the next window does not use is not moved by this step's gradient again
        (:func:`~lightning_ulysses._compat.clear_zero3_gradient_partitions`). Manual optimization: a step without a
        backward pass through the strategy (``loss.backward()`` in the step) is refused first."""
        if self._runner is not None and not self.lightning_module.automatic_optimization:
            self._runner.before_manual_optimizer_step()
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.zero_stage_3:
            _compat.clear_zero3_gradient_partitions(self.deepspeed_engine.optimizer)
        return result

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """``False``: Lightning decides where an accumulation window ends (every ``accumulate_grad_batches`` batches
        and at the end of the epoch, as on one device) and calls the optimizer step only there; the strategy tells
        DeepSpeed each micro-batch whether it ends a window (:meth:`StepRunner.follow_accumulation`). Lightning's
        own DeepSpeed strategy lets DeepSpeed count windows across epochs, so a window that does not divide the epoch
        drifts away from Lightning's steps."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: DeepSpeed reduces gradients at the accumulation boundary the strategy sets (its
        ``no_sync`` refuses ZeRO 2/3, whose gradient partitioning needs the reduction hooks)."""
        yield None

    # ----------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = _compat.attached_trainer(self.lightning_module)
        runner = self.runner
        end_of_data_check = runner.agreement.verify_end_of_data if runner.agreement is not None else None
        return prepare_dataloader(dataloader, self.layout, runner.queues, runner.context.gradients.accumulation,
                                  end_of_data_check, trainer, self._models.pad_token_id(), self._patches)

    @override
    def _auto_select_batch_size(self) -> int:
        # Lightning reads `train_dataloader.batch_sampler.batch_size`, an AttributeError for an unbatched loader.
        loader = _compat.train_loader_of(self.lightning_module.trainer)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.batch_sampler is None:
            raise ValueError(automatic_batching_off_error())
        return super()._auto_select_batch_size()

    # ----------------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's DeepSpeed checkpoint (a directory; every rank writes its shard), marked complete only once every
        rank has written, with the layout and the Hugging Face models recorded
        (:mod:`lightning_ulysses.checkpoint.markers`)."""
        if storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # raises Lightning's TypeError
        saving.save(self, checkpoint, filepath,
                    lambda content, path: super(UlyssesDeepSpeedStrategy, self).save_checkpoint(content, path),
                    module=self.lightning_module, trainer=_compat.attached_trainer(self.lightning_module))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint validated first (complete, intact, a loadable layout), loaded by DeepSpeed on the same layout
        or re-partitioned on another number of ranks or ZeRO stage (:mod:`lightning_ulysses.checkpoint.resharding`)."""
        trainer = _compat.attached_trainer(self.lightning_module)
        resuming = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        return saving.load(self, checkpoint_path, lambda: super(UlyssesDeepSpeedStrategy, self).load_checkpoint(
            checkpoint_path, weights_only), resuming=resuming, strict=strict)

    # ----------------------------------------------------------------------------------------------- lifecycle
    @override
    def teardown(self) -> None:
        if self._runner is not None:
            self._form_checks_before += self._runner.form_checks_run
        self._patches.close()  # every model, loader and library function back as it was, last change first
        self._runner = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        names = {
            "ulysses_deepspeed": ("Ulysses sequence parallelism + DeepSpeed (ZeRO stage 2)", {}),
            "ulysses_deepspeed_stage_1": ("Ulysses sequence parallelism + DeepSpeed ZeRO stage 1", {"stage": 1}),
            "ulysses_deepspeed_stage_2": ("Ulysses sequence parallelism + DeepSpeed ZeRO stage 2", {"stage": 2}),
            "ulysses_deepspeed_stage_3": ("Ulysses sequence parallelism + DeepSpeed ZeRO stage 3", {"stage": 3}),
        }
        for name, (description, init_params) in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)

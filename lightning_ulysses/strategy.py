"""``UlyssesDeepSpeedStrategy``: Lightning's DeepSpeed strategy plus Ulysses sequence parallelism. Glue only: the
layout, the attention exchange, the data path and the loss live in their own modules; the strategy's hooks around
steps (:mod:`~lightning_ulysses.step_hooks`), for loaders (:mod:`~lightning_ulysses.loader_hooks`), checkpoints
(:mod:`~lightning_ulysses.checkpoint_hooks`), the DeepSpeed engine (:mod:`~lightning_ulysses.engine_setup`) and the
step API of a ``training_step`` (:mod:`~lightning_ulysses.step_api`) are mixed in from theirs. This file: the
arguments, the layout, preparing the models before DeepSpeed's engine exists, and giving everything back after."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Generator, Optional, Sequence

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from typing_extensions import override

from lightning_ulysses import (building, calls, form_check, generation, hf, hf_attention, litgpt_models, memory, moe,
                               refusals)
from lightning_ulysses.agreement import SPAgreement
from lightning_ulysses.attention import ModuleSelector, find_attention_cores, unwrap_attention_core, wrap_attention_core
from lightning_ulysses.checkpoint_hooks import CheckpointHooks
from lightning_ulysses.context import StepContext
from lightning_ulysses.engine_setup import DeepSpeedEngineSetup, use_deepspeed_cpu_accelerator
from lightning_ulysses.geometry import SequenceGeometry
from lightning_ulysses.layout import (
    SequenceParallelLayout,
    node_spanning_warning,
    sp_groups_span_nodes,
    validate_ring_size,
    validate_sp_size,
)
from lightning_ulysses.loader_hooks import LoaderHooks
from lightning_ulysses.loaders import ShardInfoQueue, restore_loader
from lightning_ulysses.loss import whole_loss_gradient_factor
from lightning_ulysses.step_api import StepAPI
from lightning_ulysses.step_hooks import StepHooks


class UlyssesDeepSpeedStrategy(StepHooks, StepAPI, LoaderHooks, CheckpointHooks, DeepSpeedEngineSetup,
                               DeepSpeedStrategy):
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
      so that every rank receives its sequence shard (see :func:`lightning_ulysses.data.shard_batch`).

    Runs on CUDA (nccl) and on CPU (gloo, DeepSpeed's CPU accelerator).

    Args:
        sp_size: Ranks per sequence-parallel group. Must divide the world size (``num_nodes × devices``) and, with
            ``ring_size``, leave at least one attention head per Ulysses rank (``sp_size / ring_size <= heads``;
            uneven head splits work, the busiest rank sets the pace). ``None``: the number of devices per node (SP
            inside each node, DP across nodes).
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
        gather_predictions: ``predict_step`` outputs that are per-token (``[B, s, ...]``) are gathered to the full
            ``[B, S, ...]`` on every rank of the SP group. ``False`` keeps each rank's shard (saves memory).
        check_sp_agreement: before every step, the ranks of each SP group verify that they hold the same full batch
            (a digest of the full batch taken in the collate step, compared with one all-reduce of 6 integers over
            the SP group), and a loader that runs out of batches on one peer but not on another stops all of them;
            after every backward pass, before the optimizer step, they verify that they back-propagated the same
            loss through the same use of the strategy's SP losses (one all-reduce of 8 numbers; catches losses
            averaged over a shard and hand-made cross-rank weightings). A mismatch raises on every rank. Turn off
            only if your peers provably read the same data and your loss is the same on every rank.
        verify_checkpoints: record every checkpoint file's SHA-256 in the completion marker when saving (each rank
            hashes a share of the files) and check them before resuming or evaluating from a checkpoint; a file
            whose bytes changed is refused. ``False`` skips the hashing on both sides (sizes are still checked).
        check_model_form: before the first step of every Trainer stage (fit, validate, test, predict), run the
            model on a short probe whole and sharded on every rank and stop, before any weight changes, if its output
            depends on which shard a rank holds (a model that computes positions, a RoPE frequency choice or a window
            from its shard as if it were the whole sequence; see :mod:`lightning_ulysses.form_check`). Two forward
            passes of a few tokens per stage. ``False`` skips it.
        ring_size: Hybrid Ulysses × ring sequence parallelism (USP): the SP group is ``ring_size`` ring groups of
            ``sp_size / ring_size`` Ulysses ranks (consecutive ranks, so a Ulysses group stays inside a node).
            Attention exchanges heads over the Ulysses ranks, then attends across the ring groups (key/value blocks
            passed around the ring point to point, load-balanced zigzag sequence layout). Lifts the head limit: only
            ``sp_size / ring_size`` must fit the heads. 1 (default): Ulysses only. Any attention implementation
            (the ring runs its own block kernels); packed documents are kept apart.
        **kwargs: Every argument of :class:`~lightning.pytorch.strategies.DeepSpeedStrategy` (``stage``,
            ``offload_optimizer``, ``config``, ...).
    """

    strategy_name = "ulysses_deepspeed"

    def __init__(
        self,
        sp_size: Optional[int] = None,
        sdpa_per_document: bool = False,
        gather_predictions: bool = True,
        attention_modules: Optional[Sequence[ModuleSelector]] = None,
        tiled_mlp: memory.TileSetting = 0,
        tiled_loss: memory.TileSetting = 0,
        offload_checkpoints: bool = False,
        check_sp_agreement: bool = True,
        verify_checkpoints: bool = True,
        ring_size: int = 1,
        check_model_form: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sp_size is not None:
            validate_sp_size(sp_size, sp_size)  # type and sign; the world size is checked once it is known
        validate_ring_size(ring_size, sp_size if sp_size is not None else ring_size)  # divisibility once known
        self.ring_size = ring_size
        self._requested_sp_size = sp_size
        self.sdpa_per_document = sdpa_per_document
        self.gather_predictions = gather_predictions
        self.attention_modules = list(attention_modules or [])
        self.memory_features = memory.MemoryFeatures(tiled_mlp, tiled_loss, offload_checkpoints)
        self._wrapped_cores: list[Module] = []
        self._layout: Optional[SequenceParallelLayout] = None
        self._context: Optional[StepContext] = None
        self._prepared_models: list[Module] = []
        self._saved_modes: building.ModuleModes = []
        self.check_sp_agreement = check_sp_agreement
        self.verify_checkpoints = verify_checkpoints
        self.check_model_form = check_model_form
        self._form_check_pending = False
        self._form_check_roots: list[Module] = []
        self.form_checks_run = 0  # model-form checks passed by this strategy (one per Trainer stage)
        self._agreement: Optional[SPAgreement] = None
        self._step_queues: dict[str, ShardInfoQueue] = {}
        self._prepared_loaders: list[Any] = []  # given their own collate functions back in teardown
        self._own_model_roots: list[Module] = []
        self._litgpt_models: list[Module] = []  # LitGPT GPTs, prepared by lightning_ulysses.litgpt_models
        self._patches = ExitStack()  # process-global patches held while models are prepared (closed in teardown)
        self._step_shift_labels: Optional[torch.Tensor] = None

    # ----------------------------------------------------------------------------------------------- layout
    @property
    def sp_size(self) -> int:
        """Ranks per SP group (resolved from the devices per node if ``sp_size=None`` was given)."""
        if self._requested_sp_size is not None:
            return self._requested_sp_size
        return self.num_processes

    @property
    def layout(self) -> SequenceParallelLayout:
        """The DP×SP layout (mesh, groups, ranks); exists once the process group is set up."""
        if self._layout is None:
            raise RuntimeError("The sequence-parallel layout exists only after the Trainer has set up the processes.")
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "ring", "ulysses")`` device mesh (the flattened ``"sp"`` mesh: ``layout.sp_mesh``)."""
        return self.layout.mesh

    @property
    def sp_group(self) -> torch.distributed.ProcessGroup:
        return self.layout.sp_group

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @override
    def setup_environment(self) -> None:
        validate_sp_size(self.sp_size, self.num_nodes * self.num_processes)
        validate_ring_size(self.ring_size, self.sp_size)
        ulysses = SequenceGeometry(self.sp_size, self.ring_size).ulysses_size  # all-to-all group; ring may cross nodes
        if sp_groups_span_nodes(ulysses, self.num_processes, self.num_nodes):
            rank_zero_warn(node_spanning_warning(ulysses, self.num_processes, self.num_nodes, self.ring_size))
        if isinstance(self.accelerator, CPUAccelerator):
            use_deepspeed_cpu_accelerator()
        # Lightning's DeepSpeedStrategy refuses anything but CUDA; the DDP setup underneath works for CPU/gloo too.
        DDPStrategy.setup_environment(self)
        if self._layout is None:
            self._layout = SequenceParallelLayout.build(self.root_device.type, self.sp_size, self.ring_size)
        if self.check_sp_agreement and self.sp_size > 1:
            self._agreement = SPAgreement(self._layout.sp_group, self._layout.sp_group_ranks(), self.root_device)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._layout.mesh

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # CPU devices carry no index, so the parent's CUDA device-index check does not apply.
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
            return
        super().setup_distributed()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # All ranks of an SP group read the same samples: the sampler is split over the dp replicas only.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ----------------------------------------------------------------------------------------------- model
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning's ``deepspeed.zero.Init`` (ZeRO-3: parameters partitioned as they are created) around
        ``configure_model``, with transformers told that ZeRO-3 is active while the block runs, so that
        ``from_pretrained`` / ``from_config`` there load and initialise partitioned weights correctly, and with
        ``torch.nn.init`` working on partitioned parameters (PEFT initialises LoRA layers after building them)."""
        with super().model_sharded_context():
            if self.zero_stage_3:
                assert isinstance(self.config, dict)
                with building.transformers_zero3_aware(self.config), building.partition_aware_init():
                    yield
            else:
                yield

    @override
    def init_deepspeed(self) -> None:
        self._prepare_models()
        super().init_deepspeed()

    def _prepare_models(self) -> None:
        """Validate and switch every HF model to Ulysses attention + SP loss (before any compute)."""
        assert self.lightning_module is not None and isinstance(self.config, dict)
        refusals.refuse_tuning_callbacks(self.lightning_module.trainer.callbacks)
        models = hf.find_pretrained_models(self.lightning_module)
        cores = [m for _, m in find_attention_cores(self.lightning_module, self.attention_modules)]
        litgpt = litgpt_models.find_litgpt_models(self.lightning_module)
        if not models and not cores and not litgpt and self.sp_size > 1:
            raise ValueError(
                f"UlyssesDeepSpeedStrategy(sp_size={self.sp_size}) found no Hugging Face PreTrainedModel and no"
                " attention core in the LightningModule, so there is no attention to run over the whole sequence:"
                " each rank would attend only within its own shard and train a different model. Declare your"
                " attention cores with `attention_modules=[...]` (classes or name patterns; see"
                " docs/data-and-training-step.md, 'Your own model'), mark them with `ulysses_attention_core = True`, or use `sp_size=1`."
            )
        for model in models:
            refusals.validate_model(model, self.sp_size, self.root_device.type, self.ring_size)
        for model in litgpt:
            refusals.validate_litgpt_model(model, self.sp_size, self.ring_size)
        if cores and self.ring_size > 1:
            raise ValueError(
                f"attention_modules (your own attention cores) are not supported with ring_size={self.ring_size} yet:"
                " use ring_size=1."
            )
        hf_attention.register_attention_functions()
        accumulation = int(self.config.get("gradient_accumulation_steps", 1))
        self._context = StepContext(
            sp_group=self.sp_group,
            grad_scale=float(self.dp_size * self.sp_size),  # SP losses act as terms replicated on every rank
            loss_scale=whole_loss_gradient_factor(self.config, self.sp_size, self.dp_size, accumulation),
            accumulation=accumulation,
            sdpa_per_document=self.sdpa_per_document,
            ulysses_group=self.layout.ulysses_group,
            ring_group=self.layout.ring_group,
            ring_size=self.ring_size,
            incoming_gradients=[],
            zero_stage_3=self.zero_stage_3,
        )
        for model in models:
            hf.prepare_model(model, self._context)
            memory.enable(model, self.memory_features, self._context)
            generation.install_plain_generate(model, self._context, self.zero_stage_3)
        self._patches.close()
        self._patches.enter_context(moe.exact_load_balancing_loss(models, self._context))
        self._prepared_models = models
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._saved_modes.extend(building.train_mode_for_fit(models))
        for model in litgpt:
            litgpt_models.prepare_litgpt(model, self._context)
        self._litgpt_models = litgpt
        for core in cores:
            wrap_attention_core(core, self.sp_group, self._context)
        self._wrapped_cores = cores
        # Own models: the outermost modules around the attention cores whose forward takes `position_ids` get the
        # shard's positions when called without them.
        self._own_model_roots = calls.position_taking_roots(self.lightning_module, cores)
        for root in self._own_model_roots:
            calls.install_call_completion(root, self._context, hf_model=False)
        self._form_check_roots = form_check.own_model_roots(self.lightning_module, cores, models,
                                                            self._own_model_roots)
        self._form_check_pending = self.check_model_form and self.sp_size > 1

    def _check_model_form(self, batch: Any) -> None:
        """The model-form check on the first step's batch (:mod:`lightning_ulysses.form_check`)."""
        context = self._context
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if context is None or context.shard_info is None or not isinstance(ids, torch.Tensor):
            return
        models = self._prepared_models
        probe = form_check.build_probe(context.shard_info, ids, self.layout.geometry, self.sp_rank, self.sp_group,
                                       form_check.longest_window(models))
        targets = [(m, form_check.whole_hf_call, form_check.sharded_hf_call) for m in models]
        targets += [(root, form_check.whole_own_call, form_check.sharded_own_call) for root in self._form_check_roots]
        targets += [(m, form_check.whole_litgpt_call, form_check.sharded_own_call) for m in self._litgpt_models]
        form_check.check_model_form(targets, probe, context, self.root_device, self._plain_models)
        self.form_checks_run += 1

    @contextmanager
    def _plain_models(self) -> Generator[None, None, None]:
        """Every prepared model and attention core runs plain (unsharded) inside the block."""
        assert self._context is not None
        with ExitStack() as stack:
            for model in self._prepared_models:
                stack.enter_context(hf.plain_mode(model, self._context))
            self._context.plain = True
            try:
                yield
            finally:
                self._context.plain = False

    def _reinstall_model_hooks(self) -> None:
        """The prepared models' forward pre-hooks again, after Lightning's DeepSpeed inference set-up removed every
        module's hooks (``remove_module_hooks``): without them a call during ``trainer.predict/test/validate`` would
        get positions counted from 0 on every rank."""
        assert self._context is not None
        for model in self._prepared_models:
            hf.reinstall_hooks(model, self._context)
        for root in self._own_model_roots:
            calls.remove_call_completion(root)
            calls.install_call_completion(root, self._context, hf_model=False)
        for model in self._litgpt_models:
            litgpt_models.reinstall_hooks(model, self._context)

    def _check_model_hooks(self) -> None:
        """Every prepared model still has its call-completion hook (checked before each step: something that clears
        module hooks after the strategy prepared the models would otherwise let shards run as whole sequences)."""
        for model in [*self._prepared_models, *self._own_model_roots, *self._litgpt_models]:
            present = (litgpt_models.has_hooks(model) if litgpt_models.is_litgpt_gpt(model)
                       else calls.has_call_completion(model))
            if not present:
                raise RuntimeError(
                    f"The forward pre-hook UlyssesDeepSpeedStrategy installed on {type(model).__name__} is gone: something"
                    " removed the module hooks after the strategy prepared the model (Lightning's DeepSpeed inference"
                    " set-up does, and the strategy installs them again after it; a newer Lightning may do it"
                    " elsewhere). Without it the model's calls would get positions of the shard counted from 0."
                    " Please report this with your Lightning version."
                )

    # ----------------------------------------------------------------------------------------------- lifecycle
    @override
    def teardown(self) -> None:
        self._patches.close()
        building.restore_modes(self._saved_modes)
        self._saved_modes = []
        for model in self._prepared_models:
            memory.disable(model)
            hf.restore_model(model)
            generation.remove_plain_generate(model)
        for core in self._wrapped_cores:
            unwrap_attention_core(core)
        for root in self._own_model_roots:
            calls.remove_call_completion(root)
        for model in self._litgpt_models:
            litgpt_models.restore_litgpt(model)
        self._litgpt_models = []
        for loader in self._prepared_loaders:
            restore_loader(loader)
        self._prepared_models, self._wrapped_cores, self._own_model_roots = [], [], []
        self._prepared_loaders = []
        self._context = None
        self._step_queues = {}
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

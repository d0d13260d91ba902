"""``UlyssesDeepSpeedStrategy``: Lightning's DeepSpeed strategy plus Ulysses sequence parallelism. Glue only: the
layout, the attention exchange, the data path and the loss live in their own modules."""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Generator, Optional, Sequence, Union

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ulysses import calls, generation
from lightning_ulysses import checkpoint as _checkpoint
from lightning_ulysses import building, hf, hf_attention, memory, moe, refusals, resharding
from lightning_ulysses.agreement import SPAgreement, sampler_split_error
from lightning_ulysses.attention import ModuleSelector, find_attention_cores, unwrap_attention_core, wrap_attention_core
from lightning_ulysses.context import SHARD_INFO_KEY, ShardInfo, StepContext
from lightning_ulysses.data import automatic_batching_off_error, install_sharding_collate
from lightning_ulysses.loaders import StepStateQueue, prepare_loader, restore_loader
from lightning_ulysses.layout import (
    SequenceParallelLayout,
    node_spanning_warning,
    sp_groups_span_nodes,
    validate_ring_size,
    validate_sp_size,
)
from lightning_ulysses.loss import (
    broadcast_token_weights,
    scale_gradient,
    step_cross_entropy,
    step_token_mean,
    whole_loss_gradient_factor,
)
from lightning_ulysses.outputs import gather_sequence_outputs


class UlyssesDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO training with Ulysses sequence parallelism (DeepSpeed Ulysses / ALST) for long sequences.

    Each sequence is split across ``sp_size`` ranks: every rank holds ``S / sp_size`` tokens with all heads, and
    around attention an all-to-all swaps to all ``S`` tokens with ``heads / sp_size`` heads, attention runs locally,
    and a second all-to-all swaps back. Activation memory per rank falls by ``sp_size``; the training is numerically
    the one a single device would run (same losses, same gradients, at every ZeRO stage).

    What the strategy does, with no change to the LightningModule:

    * builds a DP×SP :class:`~torch.distributed.device_mesh.DeviceMesh` (dims ``("dp", "sp")``, SP innermost so an
      SP group stays inside a node), reachable as ``strategy.device_mesh`` and ``LightningModule.device_mesh``;
    * hands DeepSpeed the SP groups, so ZeRO's batch arithmetic uses dp while gradients reduce over all ranks;
    * switches every Hugging Face ``PreTrainedModel`` in the LightningModule to Ulysses attention (``sdpa``,
      ``flash_attention_2/3`` or ``flex_attention``) and to a loss whose value is the full-sequence loss;
    * gives the train/val/test/predict samplers ``num_replicas=dp`` and wraps each DataLoader's collate function
      so that every rank receives its sequence shard (see :func:`lightning_ulysses.data.shard_batch`).

    Runs on CUDA (nccl) and on CPU (gloo, DeepSpeed's CPU accelerator).

    Args:
        sp_size: Ranks per sequence-parallel group. Must divide the world size (``num_nodes × devices``), the number
            of attention heads, and divide or be a multiple of the number of KV heads. ``None``: the number of
            devices per node (SP inside each node, DP across nodes).
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
        ring_size: Hybrid Ulysses × ring sequence parallelism (USP): the SP group is ``ring_size`` ring groups of
            ``sp_size / ring_size`` Ulysses ranks (consecutive ranks, so a Ulysses group stays inside a node).
            Attention exchanges heads over the Ulysses ranks, then attends across the ring groups (key/value blocks
            passed around the ring point to point, load-balanced zigzag sequence layout). Lifts the head limit: only
            ``sp_size / ring_size`` must fit the heads. 1 (default): Ulysses only. Needs ``sdpa``; one document
            per row.
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
        self._agreement: Optional[SPAgreement] = None
        self._step_queues: dict[str, StepStateQueue] = {}
        self._prepared_loaders: list[Any] = []  # given their own collate functions back in teardown
        self._own_model_roots: list[Module] = []
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
        """The ``("dp", "sp")`` device mesh."""
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
        ulysses = self.sp_size // self.ring_size  # the all-to-all group; ring traffic may cross nodes
        if sp_groups_span_nodes(ulysses, self.num_processes, self.num_nodes):
            rank_zero_warn(node_spanning_warning(ulysses, self.num_processes, self.num_nodes, self.ring_size))
        if isinstance(self.accelerator, CPUAccelerator):
            _use_deepspeed_cpu_accelerator()
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
        models = hf.find_pretrained_models(self.lightning_module)
        cores = [m for _, m in find_attention_cores(self.lightning_module, self.attention_modules)]
        if not models and not cores and self.sp_size > 1:
            raise ValueError(
                f"UlyssesDeepSpeedStrategy(sp_size={self.sp_size}) found no Hugging Face PreTrainedModel and no"
                " attention core in the LightningModule, so there is no attention to run over the whole sequence:"
                " each rank would attend only within its own shard and train a different model. Declare your"
                " attention cores with `attention_modules=[...]` (classes or name patterns; see"
                " docs/data-and-training-step.md, 'Your own model'), mark them with `ulysses_attention_core = True`, or use `sp_size=1`."
            )
        for model in models:
            refusals.validate_model(model, self.sp_size, self.root_device.type, self.ring_size)
        if cores and self.ring_size > 1:
            raise ValueError(
                f"attention_modules (your own attention cores) are not supported with ring_size={self.ring_size} yet:"
                " use ring_size=1."
            )
        hf_attention.register_attention_functions()
        accumulation = int(self.config.get("gradient_accumulation_steps", 1))
        self._context = StepContext(
            sp_group=self.sp_group,
            loss_group=None,  # every rank: the loss is token-weighted over the global batch
            grad_scale=float(self.dp_size * self.sp_size),  # SP losses act as terms replicated on every rank
            loss_scale=whole_loss_gradient_factor(self.config, self.sp_size, self.dp_size, accumulation),
            accumulation=accumulation,
            sdpa_per_document=self.sdpa_per_document,
            ulysses_group=self.layout.ulysses_group,
            ring_group=self.layout.ring_group,
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
            self._switch_to_train_mode(models)
        for core in cores:
            wrap_attention_core(core, self.sp_group)
        self._wrapped_cores = cores
        # Own models: the outermost modules around the attention cores whose forward takes `position_ids` get the
        # shard's positions when called without them.
        self._own_model_roots = calls.position_taking_roots(self.lightning_module, cores)
        for root in self._own_model_roots:
            calls.install_call_completion(root, self._context, hf_model=False)

    def _switch_to_train_mode(self, models: list[Module]) -> None:
        """``from_pretrained`` returns models in eval mode and Lightning keeps submodule modes: without this, fit
        would silently run such a model without gradient checkpointing and dropout. Undone in ``teardown``."""
        for model in models:
            modes = building.switch_to_train_mode(model)
            if modes:
                rank_zero_info(
                    f"UlyssesDeepSpeedStrategy: {type(model).__name__} was in eval mode (as `from_pretrained` returns"
                    " models); it trains in train mode (dropout, gradient checkpointing on) and gets its modes back"
                    " after fit. To keep parts frozen in eval mode, call `.eval()` on those submodules only."
                )
            self._saved_modes.extend(modes)

    @property
    def step_context(self) -> StepContext:
        """What the prepared models' attention and loss read during the current step."""
        if self._context is None:
            raise RuntimeError("The step context exists once the Trainer has set up the strategy.")
        return self._context

    def shard_positions(self, shard_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions ``[shard_len]`` of this rank's sequence shard (for rotary/absolute position embeddings
        of your own model; batches from the strategy's loaders also carry them as ``position_ids``)."""
        if self.ring_size > 1:
            raise RuntimeError("shard_positions: with ring_size > 1 the shard is not contiguous; use the batch's"
                               " position_ids.")
        start = self.sp_rank * shard_len
        return torch.arange(start, start + shard_len, device=device or self.root_device)

    @property
    def current_shard(self) -> Optional[ShardInfo]:
        """Facts about the full batch of the current step (length before padding, packed documents)."""
        return self._context.shard if self._context is not None else None

    @property
    def prepared_models(self) -> list[Module]:
        """The Hugging Face models the strategy switched to Ulysses attention (during fit/validate/test/predict)."""
        return list(self._prepared_models)

    def token_losses(self) -> torch.Tensor:
        """Per-token cross-entropy ``[B, s]`` of this rank's shard from the last forward pass of a prepared model
        run without gradients (``validation_step``/``test_step``/``predict_step``), fp32, 0 where there is no
        target. Works with ``tiled_loss`` (no full logits). Pair it with the batch's ``position_ids`` and
        ``shift_labels`` (e.g. :class:`lightning_ulysses.PositionalLoss`)."""
        return self._token_stats()[0]

    def token_correct(self) -> torch.Tensor:
        """``[B, s]`` bool: whether the argmax of each position's logits is its target (see :meth:`token_losses`)."""
        return self._token_stats()[1]

    def _token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self._context.token_stats if self._context is not None else None
        if stats is None:
            raise RuntimeError(
                "No per-token losses recorded for this step: they come from the loss of a prepared Hugging Face"
                " model's forward pass with labels, run without gradients (validation/test/predict). Call"
                " `self.model(**batch)` with the batch's labels first."
            )
        return stats

    @torch.no_grad()
    def evaluate_full_batch(self, model: Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run a prepared model on a FULL batch (``input_ids`` ``[B, S]``, ``labels``; the same on every rank of the
        SP group) outside the Trainer's loops, e.g. from a callback: the batch is cut into this rank's shard, the
        model runs sequence-parallel without gradients, and this rank's shard statistics come back:
        ``{"loss": [B, s], "correct": [B, s], "shift_labels": [B, s], "position_ids": [B, s]}``. Every rank of the
        world must call it the same number of times (the loss reduces over all ranks)."""
        from lightning_ulysses.data import shard_batch

        shard = shard_batch(batch, self.sp_size, self.sp_rank, self._pad_token_id(), ring_size=self.ring_size)
        info = shard.pop(SHARD_INFO_KEY)
        context = self.step_context
        previous = context.shard, context.tile_shard_len, context.token_stats, context.in_step
        context.shard, context.tile_shard_len, context.token_stats = info, self._agreed_tile_shard_len(info), None
        context.in_step = True
        try:
            shard = {k: v.to(self.root_device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
            model(**shard)
            losses, correct = self._token_stats()
        finally:
            context.shard, context.tile_shard_len, context.token_stats, context.in_step = previous
        return {"loss": losses, "correct": correct, "shift_labels": shard["shift_labels"],
                "position_ids": shard["position_ids"]}

    def cross_entropy(self, logits: torch.Tensor, shift_labels: torch.Tensor,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's target tokens from this rank's ``[B, s, V]`` logits and
        ``[B, s]`` ``shift_labels``, for a ``training_step`` that computes its own loss. Same value on every rank,
        the single-device value; exact gradients at every ZeRO stage and with gradient accumulation.

        ``weight``: ``[B]`` per-sample or ``[B, s]`` per-target weights (aligned with ``shift_labels``; for weights
        given per input token use :meth:`next_token_values`): the loss is then ``sum(w · ce) / sum(w)`` over the
        target tokens of the whole batch, as ``(ce * w).sum() / w.sum()`` on one device."""
        return step_cross_entropy(self.step_context, logits, shift_labels, weight=weight)

    def token_mean(self, values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Weighted mean of per-token ``values`` ``[B, s]`` over the whole batch (every rank's shard): the value a
        single device computes as ``(values * w).sum() / w.sum()`` on the full batch, the same number on every rank,
        with exact gradients. Use it for every per-token term of a loss (auxiliary losses on logits or hidden states,
        weighted token losses): a mean over this rank's shard would be a different function on every rank.

        Args:
            values: ``[B, s]`` per-token values of this rank's shard (e.g. ``F.cross_entropy(..., reduction="none")``
                against ``batch["shift_labels"]``, or ``logits.logsumexp(-1) ** 2``).
            weights: ``[B]`` per-sample or ``[B, s]`` per-token weights; ``None``: 1.
            mask: ``[B, s]`` which positions count; ``None``: the step's target tokens (``shift_labels != -100``),
                or, if the batch has no labels, its real tokens (no padding).

        With gradient accumulation the mean is taken per micro-batch, and the micro-batches are averaged as Lightning
        averages them on one device."""
        context = self.step_context
        shard = context.shard
        if shard is None or shard.shard_shape is None:
            raise RuntimeError("token_mean is for use inside a step, on tensors of this rank's shard.")
        if tuple(values.shape[:2]) != shard.shard_shape:
            raise ValueError(f"token_mean: values must be [B, s] = {list(shard.shard_shape)} (this rank's shard),"
                             f" got {list(values.shape)}.")
        if mask is None:
            mask = self._default_token_mask(shard)
        w = mask.to(values.device).float()
        if weights is not None:
            w = w * broadcast_token_weights(weights, values)
        return step_token_mean(context, values, w)

    def _default_token_mask(self, shard: ShardInfo) -> torch.Tensor:
        if self._step_shift_labels is not None:
            return self._step_shift_labels != -100
        real = torch.ones(shard.shard_shape, dtype=torch.bool)  # type: ignore[arg-type]
        if shard.attention_mask is not None:
            real &= shard.attention_mask.bool()
        real &= shard.global_index[None, :] < shard.seq_len  # not the padding to the SP multiple
        return real

    def next_token_values(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """``[B, s, ...]`` -> ``[B, s, ...]``: at every position of this rank's shard, the value at the next position of
        the full sequence (``fill`` after the last one), across shard boundaries: what ``values[:, 1:]`` is on one
        device. For per-token tensors of the batch that must line up with the targets, e.g. token weights:
        ``strategy.cross_entropy(logits, batch["shift_labels"], weight=strategy.next_token_values(batch["w"]))``.
        One all-gather of ``[B, 1 or 2, ...]`` over the SP group; every SP rank must call it."""
        shard = self.step_context.shard
        if shard is None or shard.halo is None:
            raise RuntimeError("next_token_values is for use inside a step, on tensors of this rank's shard.")
        return calls.next_token_values(values, shard, self.sp_group, fill)

    # ----------------------------------------------------------------------------------------------- steps
    def _begin_step(self, kind: str, batch: Any = None) -> None:
        """Take the facts of this step's batch from the queue its loader filled (before any compute): check that the
        SP peers hold the same batch, check packing support, and put them into the step context."""
        if batch is not None and hasattr(batch, "__next__"):
            raise ValueError(
                f"UlyssesDeepSpeedStrategy does not support a {kind} step that takes the dataloader iterator"
                " (`dataloader_iter`): the strategy pairs every batch with its sharding facts when the loop fetches"
                " it. Take `batch` as the step's argument instead."
            )
        queue = self._step_queues.get(kind)
        shard = queue.pop() if queue is not None else None
        if shard is None:
            raise RuntimeError(
                f"UlyssesDeepSpeedStrategy has no sharding facts for this {kind} batch: it did not come from a"
                " DataLoader the strategy prepared (Lightning passes every loader of the Trainer through"
                " `strategy.process_dataloader`; iterating a loader yourself inside a step is not supported)."
            )
        if self._agreement is not None and shard.fingerprint is not None:
            self._agreement.verify(shard.fingerprint, shard.seq_len, shard.batch_size, where=f"{kind} step")
        if shard.packed and self.ring_size == 1:  # the ring kernel keeps documents apart itself
            for model in self._prepared_models:
                impl = hf_attention.attention_implementation(model)
                if not hf_attention.keeps_documents_apart(impl, self.sdpa_per_document):
                    raise ValueError(hf_attention.packed_documents_error(impl))
        if self._context is not None:
            self._context.shard = shard
            self._context.tile_shard_len = self._agreed_tile_shard_len(shard)
            self._context.token_stats = None

    def _agreed_tile_shard_len(self, shard: ShardInfo) -> Optional[int]:
        """With tile counts that follow the shard length under ZeRO-3 and several replicas, the step's longest shard
        over all ranks (one scalar all-reduce per step), so that every rank runs as many tiles: ZeRO-3 gathers the
        tiled modules' weights once per tile and all ranks must issue the same gathers. Else ``None``."""
        if not (self.memory_features.auto and self.zero_stage_3 and self.dp_size > 1):
            return None
        local = torch.tensor([-(-shard.seq_len // self.sp_size)], dtype=torch.int64, device=self.root_device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)  # [1]: max shard length, world
        return int(local.item())

    @contextmanager
    def _step(self, kind: str, batch: Any) -> Generator[None, None, None]:
        self._begin_step(kind, batch)
        self._step_shift_labels = batch.get("shift_labels") if isinstance(batch, dict) else None
        if self._context is not None:
            self._context.in_step = True
            self._context.step_batch_tensors = (
                {key: batch.get(key) for key in ("position_ids", "attention_mask")} if isinstance(batch, dict) else {})
            if kind == "train":
                self._context.incoming_gradients = []
        try:
            yield
        finally:
            if self._context is not None:
                self._context.in_step = False
            self._step_shift_labels = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._follow_lightnings_accumulation()
        with self._step("train", batch):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step("validate", args[0] if args else kwargs.get("batch")):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step("test", args[0] if args else kwargs.get("batch")):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        local_shape = tuple(batch["input_ids"].shape[:2]) if isinstance(batch, dict) and "input_ids" in batch else None
        with self._step("predict", batch):
            output = super().predict_step(*args, **kwargs)
        if not self.gather_predictions or local_shape is None or self.current_shard is None:
            return output
        order = None
        if self.ring_size > 1:
            from lightning_ulysses.ring import full_order, padded_length

            ulysses = self.sp_size // self.ring_size
            order = full_order(padded_length(self.current_shard.seq_len, self.ring_size, ulysses), self.ring_size,
                               ulysses)
        return gather_sequence_outputs(output, local_shape, self.current_shard.seq_len, self.sp_group, order)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """``False``: Lightning decides where an accumulation window ends (every ``accumulate_grad_batches`` batches
        and at the end of the epoch, as on one device) and calls the optimizer step only there; the strategy tells
        DeepSpeed each micro-batch whether it ends a window (:meth:`_follow_lightnings_accumulation`). Lightning's
        own DeepSpeed strategy lets DeepSpeed count windows across epochs, so a window that does not divide the epoch
        drifts away from Lightning's steps."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: DeepSpeed reduces gradients at the accumulation boundary the strategy sets (its
        ``no_sync`` refuses ZeRO 2/3, whose gradient partitioning needs the reduction hooks)."""
        yield None

    def _follow_lightnings_accumulation(self) -> None:
        """DeepSpeed's accumulation boundary (gradient reduction and optimizer step) follows Lightning's windows."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._context is None or self._context.accumulation <= 1 or trainer is None:
            return
        if self.lightning_module.automatic_optimization:
            self.deepspeed_engine.set_gradient_accumulation_boundary(not trainer.fit_loop._should_accumulate())

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """Back-propagate the step's loss with the whole-loss gradient factor (terms that are the same on every
        rank stay exact), then, before any weight changes, check that the SP peers back-propagated the same loss
        through the same use of the strategy's SP losses."""
        context = self._context
        if context is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        received = context.incoming_gradients  # the SP losses of this step's forward record into this list
        value = closure_loss.detach()
        scaled = scale_gradient(closure_loss, context.loss_scale)
        try:
            super().backward(scaled, optimizer, *args, **kwargs)
        except RuntimeError as err:
            if self.zero_stage_3 and "invalid gradient" in str(err) and "got [0]" in str(err):
                raise ValueError(zero3_parameters_outside_forward_error()) from err
            raise
        finally:
            context.incoming_gradients = []  # for the next forward pass
        if self._agreement is not None:
            step = self.lightning_module.trainer.global_step
            self._agreement.verify_loss(value, received, where=f"training step at global step {step}")
        return closure_loss

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optional[Optimizer],
        lr_scheduler: Optional[Union[LRScheduler, ReduceLROnPlateau]] = None,
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            mpu=self.layout.deepspeed_mpu(),
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
            mpu=self.layout.deepspeed_mpu(),
        )

    def _deepspeed_args(self) -> argparse.Namespace:
        # Lightning passes root_device.index, which is None on CPU and breaks DeepSpeed's rank arithmetic.
        index = self.root_device.index
        return argparse.Namespace(device_rank=self.local_rank if index is None else index)

    # ----------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        self._check_sampler(dataloader)
        self._seed_workers_by_dp_rank(dataloader)
        fingerprint = self._agreement is not None
        dataloader = install_sharding_collate(dataloader, self.sp_size, self.sp_rank, self._pad_token_id(),
                                              fingerprint=fingerprint, ring_size=self.ring_size)
        self._prepared_loaders.append(dataloader)  # its collate function is given back in teardown
        accumulation = self._context.accumulation if self._context is not None else 1
        trainer = getattr(self.lightning_module, "_trainer", None)
        kind = _loader_kind(trainer)
        on_exhausted = None
        if self._agreement is not None:
            agreement = self._agreement
            on_exhausted = lambda: agreement.verify_end_of_data(where=f"end of the {kind} data")  # noqa: E731
        dataloader = prepare_loader(dataloader, self._step_queues.setdefault(kind, StepStateQueue()),
                                    train=kind == "train", accumulation=accumulation,
                                    epoch_batches=self._batches_in_epoch, on_position_change=self._continue_epoch_at,
                                    on_exhausted=on_exhausted)
        return dataloader

    def _continue_epoch_at(self, batch: int) -> None:
        """A resume with another global batch continues the epoch at ``batch`` of this run's batches: Lightning's
        count of the epoch's batches (restored from the checkpoint in the saving run's batches) follows, so the
        epoch ends with the loader."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = batch - current.ready  # keep the saved counts' differences (a save inside the batch's end hooks)
        current.ready, current.started = current.ready + shift, current.started + shift
        current.processed, current.completed = current.processed + shift, current.completed + shift

    def _check_sampler(self, dataloader: Any) -> None:
        """All ranks of an SP group must read the same samples: refuse a DistributedSampler split over the world."""
        sampler = getattr(dataloader, "sampler", None)
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
            message = sampler_split_error(candidate, self.dp_size, self.dp_rank, self.sp_size)
            if message is not None:
                raise ValueError(message)

    def _seed_workers_by_dp_rank(self, dataloader: Any) -> None:
        """``seed_everything(workers=True)`` makes Lightning seed DataLoader workers by the *global* rank, so SP peers
        would draw different random crops; seed them by the data-parallel rank instead (SP peers alike, replicas
        apart; with ``sp_size=1`` this is Lightning's seeding)."""
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", 0) is None:
            from functools import partial

            from lightning.fabric.utilities.seed import pl_worker_init_function

            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self.dp_rank)

    @override
    def _auto_select_batch_size(self) -> int:
        # Lightning reads `train_dataloader.batch_sampler.batch_size`, an AttributeError for an unbatched loader.
        data_source = self.lightning_module.trainer.fit_loop._data_source
        if data_source.is_defined():
            loader = data_source.dataloader()
            if isinstance(loader, DataLoader) and loader.batch_sampler is None:
                raise ValueError(automatic_batching_off_error())
        return super()._auto_select_batch_size()

    def _batches_in_epoch(self) -> float:
        """How many batches Lightning takes from the train loader this epoch (``limit_train_batches`` applied)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return float(trainer.num_training_batches) if trainer is not None else float("inf")

    def _pad_token_id(self) -> int:
        for model in self._prepared_models:
            pad = getattr(model.config, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return 0

    # ----------------------------------------------------------------------------------------------- checkpoints
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


def zero3_parameters_outside_forward_error() -> str:
    return (
        "A term of the training step's loss uses model parameters outside the model's forward under ZeRO stage 3,"
        " where parameters are partitioned across the ranks (outside a forward pass each rank holds [0]-sized"
        " placeholders), so its gradient cannot be formed; no weight was changed. For a weight regulariser"
        " (`sum(p.pow(2).sum() for p in self.parameters())`) use the optimizer's `weight_decay`; compute other terms"
        " inside the model's forward (e.g. a forward hook), or train with ZeRO stage 1 or 2."
    )


def _loader_kind(trainer: Any) -> str:
    """Which step kind the loader being prepared feeds: "train", "validate" (also the sanity check), "test" or
    "predict"."""
    if trainer is None or trainer.training:
        return "train"
    if trainer.testing:
        return "test"
    if trainer.predicting:
        return "predict"
    return "validate"


def _use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed run on CPU when Lightning does, even on a machine whose CUDA DeepSpeed would pick."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())

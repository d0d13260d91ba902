"""What both front ends do the same way: the Trainer's :class:`~lightning_ulysses.strategy.UlyssesDeepSpeedStrategy`
and Fabric's :class:`~lightning_ulysses.fabric.UlyssesDeepSpeedStrategy` are thin glue over one implementation of the
layout, the step runner, the model preparation, the data sharding and the checkpoints; the few set-up steps they
share beyond calling those owners are here, once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module

from lightning_ulysses import _compat
from lightning_ulysses.config import SequenceParallelConfig
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.drift.guard import DriftReport, enforce_tested_versions
from lightning_ulysses.models import building
from lightning_ulysses.models.preparation import PreparedModels
from lightning_ulysses.parallel.geometry import SequenceGeometry
from lightning_ulysses.parallel.layout import (
    SequenceParallelLayout,
    node_spanning_warning,
    sp_groups_span_nodes,
    validate_ring_size,
    validate_sp_size,
)
from lightning_ulysses.patches import PatchStack
from lightning_ulysses.plan import auto as auto_plan
from lightning_ulysses.plan import preflight as preflight_check
from lightning_ulysses.training.agreement import SPAgreement
from lightning_ulysses.training.gradient_factor import GradientFactors
from lightning_ulysses.training.step_context import StepContext
from lightning_ulysses.training.step_runner import StepRunner


def check_world(sp_size: int, ring_size: int, num_nodes: int, devices_per_node: int) -> Optional[str]:
    """Validate ``sp_size`` / ``ring_size`` against the world (``ValueError`` naming what to change); returns the
    warning to show when an all-to-all group spans nodes, else ``None``."""
    validate_sp_size(sp_size, num_nodes * devices_per_node)
    validate_ring_size(ring_size, sp_size)
    ulysses = SequenceGeometry(sp_size, ring_size).ulysses_size  # the all-to-all group; the ring may cross nodes
    if sp_groups_span_nodes(ulysses, devices_per_node, num_nodes):
        return node_spanning_warning(ulysses, devices_per_node, num_nodes, ring_size)
    return None


def use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed run on CPU when Lightning does, even on a machine whose CUDA DeepSpeed would pick."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def complete_gradient_factors(runner: StepRunner, config: Mapping[str, Any], layout: SequenceParallelLayout,
                              accumulation: int, zero_stage_3: bool, tiles_follow_length: bool) -> None:
    """The step context's gradient factors and ZeRO-3 facts from the final DeepSpeed config. ``accumulation``: how
    many times the loss is divided by the accumulation count besides DeepSpeed's own division (see
    :class:`~lightning_ulysses.training.gradient_factor.GradientFactors`)."""
    runner.complete_run_facts(GradientFactors.for_config(config, layout.sp_size, layout.dp_size, accumulation),
                              zero_stage_3)
    runner.agree_on_tile_counts = tiles_follow_length and zero_stage_3 and layout.dp_size > 1


@contextmanager
def zero3_model_building(config: Mapping[str, Any], zero_stage_3: bool) -> Iterator[None]:
    """Inside DeepSpeed's ``zero.Init``: transformers told that ZeRO-3 is active (so ``from_pretrained`` /
    ``from_config`` load and initialise partitioned weights correctly) and ``torch.nn.init`` working on partitioned
    parameters (PEFT initialises LoRA layers after building them). Nothing at other stages."""
    if not zero_stage_3:
        yield
        return
    with building.transformers_zero3_aware(config), building.partition_aware_init():
        yield


class SequenceParallelFrontEnd:
    """The part of both strategies that is not Lightning glue: the sequence-parallel settings, the layout's
    properties and the public step API, each forwarded to its owner. Mixed into the Trainer's and Fabric's
    ``UlyssesDeepSpeedStrategy`` in front of Lightning's ``DeepSpeedStrategy``."""

    def _init_sequence_parallel(self, settings: SequenceParallelConfig) -> None:
        """Keep the front end's settings (validated by :class:`SequenceParallelConfig` once) and the empty state the
        set-up fills: the layout, the step runner, the prepared models, the patch stack."""
        self.settings = settings
        self._preflight_skipped: Optional[str] = None
        self._drift: Optional[DriftReport] = None  # the drift check's finding, once per strategy
        self._layout: Optional[SequenceParallelLayout] = None
        self.auto_choice: Optional[Any] = None  # sp_size="auto": the Recommendation taken (plan and estimate)
        self._runner: Optional[StepRunner] = None  # per stage (Trainer) or per set-up (Fabric)
        self._models = PreparedModels()
        self._patches = PatchStack()  # every change to the user's objects and to other libraries, closed in teardown
        self._form_checks_before = 0  # model-form checks of the stages before the current one

    # The settings read as attributes of the strategy (read-only: the config object is their one owner).
    ring_size = property(lambda self: self.settings.ring_size)
    sdpa_per_document = property(lambda self: self.settings.sdpa_per_document)
    attention_chunk = property(lambda self: self.settings.attention_chunk)
    attention_modules = property(lambda self: list(self.settings.attention_modules))
    memory_features = property(lambda self: self.settings.memory_features)
    check_sp_agreement = property(lambda self: self.settings.check_sp_agreement)
    verify_checkpoints = property(lambda self: self.settings.verify_checkpoints)
    check_model_form = property(lambda self: self.settings.check_model_form)
    allow_untested_versions = property(lambda self: self.settings.allow_untested_versions)
    memory_budget = property(lambda self: self.settings.memory_budget)
    preflight = property(lambda self: self.settings.preflight)
    gather_predictions = property(lambda self: self.settings.gather_predictions)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """All ranks of an SP group read the same samples: the sampler is split over the dp replicas only."""
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    _front_end_name = "trainer"  # which touch points the drift check runs ("trainer" or "fabric")

    def _set_up_sequence_parallel(self, set_up_processes: Callable[[], None]) -> None:
        """Both front ends' ``setup_environment``: the world checked, DeepSpeed put on CPU when Lightning runs there,
        the process group set up (``set_up_processes``: the DDP set-up under Lightning's DeepSpeed one, which
        refuses CPU), the installed libraries checked against the tested versions (on every rank, before any model
        is touched; see :mod:`lightning_ulysses.drift.guard`), then the layout and the step runner built."""
        if not self.settings.auto:
            self._check_world(self.settings.sp_size_for(self.num_processes))
        if self.root_device.type == "cpu":
            use_deepspeed_cpu_accelerator()
        set_up_processes()
        if self._drift is None:
            self._drift = enforce_tested_versions(self._front_end_name, self.root_device,
                                                  self.allow_untested_versions, rank_zero_warn)
        if self._layout is not None:  # a later stage: the runner again
            self._build_layout(self._layout.sp_size)
        elif not self.settings.auto:  # sp_size="auto": once the model is known (_choose_sp_size)
            self._build_layout(self.settings.sp_size_for(self.num_processes))

    def _check_world(self, sp_size: int) -> None:
        spanning = check_world(sp_size, self.ring_size, self.num_nodes, self.num_processes)
        if spanning is not None:
            rank_zero_warn(spanning)

    def _choose_sp_size(self, module: Module) -> None:
        """``sp_size="auto"``: the size from the memory plan of ``module``'s model (:mod:`lightning_ulysses.plan.
        auto`), then the layout and the step runner built with it; logged on rank zero. Called by the front ends once
        the model is known, before any weight is prepared or put on the device; a no-op otherwise."""
        if not self.settings.auto or self._layout is not None:
            return
        budget = self.memory_budget if self.memory_budget is not None else preflight_check.device_budget(
            self.root_device)
        budget = auto_plan.smallest_over_ranks(budget, self.root_device)
        if budget is None:
            raise ValueError(auto_plan.budget_error())
        zero = self._zero_settings()
        micro_batch = (self.config or {}).get("train_micro_batch_size_per_gpu", 1)
        settings = auto_plan.AutoSettings(
            sequence_length=int(self.settings.sequence_length), devices_per_node=self.num_processes,
            nodes=self.num_nodes, budget_bytes=int(budget), precision=self._planned_precision(),
            stage=int(zero.get("stage", 0)), memory_switches=self.memory_features.alst,
            offload_optimizer=self._offloads_optimizer(),
            micro_batch=micro_batch if isinstance(micro_batch, int) else 1,
            device_name=torch.cuda.get_device_name(self.root_device) if self.root_device.type == "cuda" else "")
        choice = auto_plan.choose_sp_size(auto_plan.planned_model_config(module), settings)
        self._check_world(choice.sp_size)
        self._build_layout(choice.sp_size)
        self.auto_choice = choice
        rank_zero_info(auto_plan.describe(choice, settings))

    def _zero_settings(self) -> Mapping[str, Any]:
        """The DeepSpeed config's ``zero_optimization`` section (empty without one)."""
        return (self.config or {}).get("zero_optimization", {})

    def _offloads_optimizer(self) -> bool:
        offload = self._zero_settings().get("offload_optimizer") or {}
        return isinstance(offload, dict) and offload.get("device", "none") != "none"

    def _planned_precision(self) -> str:
        """Lightning's precision setting of the run, as the planner names it."""
        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)
        precision = str(getattr(plugin, "precision", "32-true"))
        bf16 = bool((self.config or {}).get("bf16", {}).get("enabled"))
        return "bf16-mixed" if bf16 and precision.startswith("32") else precision

    def _build_layout(self, sp_size: int) -> None:
        if self._layout is None:
            self._layout = SequenceParallelLayout.build(self.root_device.type, sp_size, self.ring_size)
        if self._runner is None:  # one per stage (Trainer) or per set-up (Fabric); its gradient factors are
            # completed by complete_gradient_factors once the DeepSpeed config is final
            layout = self._layout
            context = StepContext(sp_group=layout.sp_group, ulysses_group=layout.ulysses_group,
                                  ring_group=layout.ring_group, ring_size=self.ring_size,
                                  sdpa_per_document=self.sdpa_per_document, incoming_gradients=[],
                                  attention_chunk=self.attention_chunk,
                                  gradients=GradientFactors(layout.dp_size, layout.sp_size),
                                  geometry=layout.geometry)
            agreement = (SPAgreement(layout.sp_group, layout.sp_group_ranks(), self.root_device)
                         if self.check_sp_agreement and layout.sp_size > 1 else None)
            self._runner = StepRunner(layout, context, self._models, agreement, self.root_device,
                                      agree_on_tile_counts=False, gather_predictions=self.gather_predictions,
                                      check_model_form=self.check_model_form)
            self._runner.after_form_check = lambda: _compat.restart_zero3_trace(self.model)  # the engine by then
            self._runner.preflight = self._preflight_first_step

    def _preflight_first_step(self, shard: ShardInfo) -> None:
        """The pre-flight memory check (:mod:`lightning_ulysses.plan.preflight`) before the first training step."""
        if self.preflight == "off":
            return
        budget = self.memory_budget if self.memory_budget is not None else preflight_check.device_budget(
            self.root_device)
        if budget is None:
            return  # on CPU without a budget: nothing to compare with
        models = list(self._models.hf_models)
        why_not = None
        if len(models) != 1:
            why_not = f"{len(models)} Hugging Face models are prepared (the plan counts one)"
        else:
            why_not = (preflight_check.not_validated(models[0])
                       or preflight_check.not_validated_on(self.root_device, self.settings.offload_attention))
        if why_not is None:
            try:
                preflight_check.check_first_step(models[0].config, shard.padded_len, shard.batch_size,
                                                 self._preflight_settings(models[0]), budget, self._any_rank,
                                                 self.preflight, rank_zero_warn, shard.vision_grids)
                return
            except preflight_check.PreflightMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - a model the meta device cannot run: every rank alike
                why_not = f"the plan could not be made ({type(err).__name__}: {err})"
        if self._preflight_skipped is None:
            self._preflight_skipped = why_not
            rank_zero_info(f"UlyssesDeepSpeedStrategy's pre-flight memory check did not run: {why_not}.")

    def _preflight_settings(self, model: Module) -> "preflight_check.PreflightSettings":
        """What the plan needs besides the model and the batch, from the layout and the final DeepSpeed config."""
        zero = self._zero_settings()
        return preflight_check.PreflightSettings(
            sp_size=self.layout.sp_size, world_size=self.world_size, stage=int(zero.get("stage", 0)),
            precision=preflight_check.precision_of(model),
            optimizer=preflight_check.optimizer_kind(getattr(self.model, "optimizer", None)),
            offload_optimizer=self._offloads_optimizer(),
            reduce_bucket_size=int(zero.get("reduce_bucket_size", 200_000_000)),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 100_000)),
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 50_000_000)),
            ring_size=self.ring_size, tiled_mlp=self.memory_features.tiled_mlp,
            tiled_loss=self.memory_features.tiled_loss, offload_checkpoints=self.memory_features.offload_checkpoints,
            gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)),
            offload_attention=self.settings.offload_attention)

    def _any_rank(self, over: bool) -> bool:
        flag = torch.tensor([int(over)], device=self.root_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # [1]: any rank over, world
        return bool(flag.item())

    @property
    def sp_size(self) -> int:
        """Ranks per SP group (the layout's once it exists; before, as requested, or the devices per node if
        ``sp_size=None`` was given; ``sp_size="auto"`` has none before it is chosen)."""
        if self._layout is not None:
            return self._layout.sp_size
        return self.settings.sp_size_for(self.num_processes)

    @property
    def layout(self) -> SequenceParallelLayout:
        """The DP×SP layout (mesh, groups, ranks); exists once the process group is set up (with
        ``sp_size="auto"``, once the model is known)."""
        if self._layout is None:
            if self.settings.auto:
                raise RuntimeError("With sp_size='auto' the sequence-parallel layout exists once the model is known:"
                                   " the Trainer chooses it before building DeepSpeed's engine, Fabric at"
                                   " fabric.setup(model, ...) (set up the model before the dataloaders).")
            raise RuntimeError("The sequence-parallel layout exists only after the Trainer or Fabric has set up the"
                               " processes.")
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

    @property
    def runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError("The step context exists once the Trainer or Fabric has set up the strategy.")
        return self._runner

    @property
    def step_context(self) -> StepContext:
        """What the prepared models' attention and loss read during the current step."""
        return self.runner.context

    @property
    def current_shard_info(self) -> Optional[ShardInfo]:
        """Facts about the full batch of the current step (length before padding, packed documents)."""
        return self._runner.context.shard_info if self._runner is not None else None

    @property
    def prepared_models(self) -> list[Module]:
        """The Hugging Face models the strategy switched to Ulysses attention (during fit/validate/test/predict)."""
        return list(self._models.hf_models)

    @property
    def form_checks_run(self) -> int:
        """Model-form checks this strategy ran and passed (one per Trainer stage with ``check_model_form``)."""
        return self._form_checks_before + (self._runner.form_checks_run if self._runner is not None else 0)

    def shard_positions(self, shard_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions ``[shard_len]`` of this rank's sequence shard (for rotary/absolute position embeddings
        of your own model; batches from the strategy's loaders also carry them as ``position_ids``). With
        ``ring_size > 1`` the shard is the zigzag pieces
        :class:`~lightning_ulysses.parallel.geometry.SequenceGeometry` places on this rank."""
        return self.runner.shard_positions(shard_len, device)

    def token_losses(self) -> torch.Tensor:
        """Per-token cross-entropy ``[B, s]`` of this rank's shard from the last forward pass of a prepared model
        run without gradients (``validation_step``/``test_step``/``predict_step``), fp32, 0 where there is no
        target. Works with ``tiled_loss`` (no full logits). Pair it with the batch's ``position_ids`` and
        ``shift_labels`` (e.g. :class:`lightning_ulysses.PositionalLoss`)."""
        return self.runner.token_stats()[0]

    def token_correct(self) -> torch.Tensor:
        """``[B, s]`` bool: whether the argmax of each position's logits is its target (see :meth:`token_losses`)."""
        return self.runner.token_stats()[1]

    def evaluate_full_batch(self, model: Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run a prepared model on a FULL batch (``input_ids`` ``[B, S]``, ``labels``; the same on every rank of the
        SP group) outside the Trainer's loops, e.g. from a callback: the batch is cut into this rank's shard, the
        model runs sequence-parallel without gradients, and this rank's shard statistics come back:
        ``{"loss": [B, s], "correct": [B, s], "shift_labels": [B, s], "position_ids": [B, s]}``. Every rank of the
        world must call it the same number of times (the loss reduces over all ranks)."""
        return self.runner.evaluate_full_batch(model, batch, self._models.pad_token_id())

    def cross_entropy(self, logits: torch.Tensor, shift_labels: torch.Tensor,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's target tokens from this rank's ``[B, s, V]`` logits and
        ``[B, s]`` ``shift_labels``, for a ``training_step`` that computes its own loss. Same value on every rank,
        the single-device value; exact gradients at every ZeRO stage and with gradient accumulation.

        ``weight``: ``[B]`` per-sample or ``[B, s]`` per-target weights (aligned with ``shift_labels``; for weights
        given per input token use :meth:`next_token_values`): the loss is then ``sum(w · ce) / sum(w)`` over the
        target tokens of the whole batch, as ``(ce * w).sum() / w.sum()`` on one device."""
        return self.runner.cross_entropy(logits, shift_labels, weight)

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
        return self.runner.token_mean(values, weights, mask)

    # ------------------------------------------------------------------ per-sequence reductions (post-training)
    def sequence_sum(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's sum over the whole sequence: ``[B, s, ...]`` values of this rank's shard -> ``[B, ...]``, the
        same on every SP rank, with exact gradients. Replaces the one-device ``(values * mask).sum(1)``, e.g. a
        sequence's log-probability for DPO: ``strategy.sequence_sum(token_logps, mask)``.

        ``mask``: ``[B, s]`` of this rank's shard, bool (which positions count) or float (weights); ``None``: the
        step's target tokens (``batch["shift_labels"] != -100``), or, if the batch has no labels, its real tokens.
        Every SP rank must call it (one all-reduce of ``[B, ...]`` over the SP group). Float weights built from this
        rank's own per-row count (``mask * (adv / mask.sum(1))[:, None]``) are refused on every rank with a
        ``ValueError`` (one more all-reduce of ``[2B + 1]`` for float weights): take counts with
        :meth:`sequence_count`."""
        return self.runner.sequence_sum(values, mask)

    def sequence_mean(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's mean over the positions of ``mask`` in the whole sequence: ``[B, s, ...]`` -> ``[B, ...]``,
        the same on every SP rank, exact gradients. Replaces ``(values * mask).sum(1) / mask.sum(1)`` (SimPO's
        length-normalised log-probability, per-sample-averaged SFT, mean pooling of an embedding model). Default
        ``mask`` as :meth:`sequence_sum`; a row with no position in the mask gives NaN, as on one device."""
        return self.runner.sequence_mean(values, mask)

    def sequence_count(self, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B]`` float64: each row's number of positions in ``mask`` over the whole sequence (no gradient), e.g. a
        per-row target count: replaces ``(batch["shift_labels"] != -100).sum(1)``, which on a shard counts only this
        rank's part. Default ``mask`` as :meth:`sequence_sum`."""
        return self.runner.sequence_count(mask)

    def last_token(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's value at its last position in ``mask``: ``[B, s, ...]`` -> ``[B, ...]``, the same on every SP
        rank, exact gradients. For reward and value heads and last-token embeddings; replaces
        ``values[torch.arange(B), attention_mask.sum(1) - 1]``. ``mask``: ``[B, s]`` bool; ``None``: the batch's
        real tokens (its ``attention_mask``, without the padding to the SP multiple)."""
        return self.runner.last_token(values, mask)

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, s, ...]`` values -> the whole rows ``[B, S, ...]`` on every SP rank, differentiable
        (backward: a reduce-scatter). Costs the full sequence's memory on every rank: prefer the reductions above,
        which never hold it; for objectives that need all positions at once."""
        return self.runner.gather_sequence(values)

    def next_token_values(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """``[B, s, ...]`` -> ``[B, s, ...]``: at every position of this rank's shard, the value at the next position of
        the full sequence (``fill`` after the last one), across shard boundaries: what ``values[:, 1:]`` is on one
        device. For per-token tensors of the batch that must line up with the targets, e.g. token weights:
        ``strategy.cross_entropy(logits, batch["shift_labels"], weight=strategy.next_token_values(batch["w"]))``.
        One all-gather of ``[B, 1 or 2, ...]`` over the SP group; every SP rank must call it."""
        return self.runner.next_token_values(values, fill)


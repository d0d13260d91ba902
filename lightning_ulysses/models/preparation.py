"""The models of a LightningModule, found, validated and prepared for one Trainer stage, and put back after it.

:class:`PreparedModels` finds every Hugging Face ``PreTrainedModel``, every declared attention core, every LitGPT
``GPT`` and every own model that takes positions; refuses what is not supported before any compute; switches each to
its sequence-parallel form; and enters every change into the strategy's :class:`~lightning_ulysses.patches.PatchStack`,
so that closing the stack in teardown gives every model back as it was.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_ulysses import _compat
from lightning_ulysses.models import building, cross_module_reads, form_check, hf, hf_attention, memory, moe
from lightning_ulysses.models import vision_language
from lightning_ulysses.models.adapters import ADAPTER_OF, ADAPTERS, ModelAdapter, PreparationSettings
from lightning_ulysses.parallel.attention import ModuleSelector
from lightning_ulysses.parallel.layout import SequenceParallelLayout
from lightning_ulysses.patches import PatchStack
from lightning_ulysses.training.step_context import StepContext


class PreparedModels:
    """What the strategy prepared in the LightningModule for the current stage (empty outside a stage)."""

    def __init__(self) -> None:
        self.hf_models: list[Module] = []  # Hugging Face PreTrainedModels
        self.cores: list[Module] = []  # declared attention cores of own models
        self.own_roots: list[Module] = []  # own models whose forward takes positions (call completion)
        self.litgpt: list[Module] = []  # LitGPT GPTs
        self.form_check_roots: list[Module] = []  # own models the model-form check runs
        self._found: dict[str, list[Module]] = {}  # every prepared model by its adapter's kind
        self._named_parameters: list[tuple[str, torch.nn.Parameter]] = []  # the prepared module's, in its order

    def prepare(self, lightning_module: Module, context: StepContext, patches: PatchStack, *,
                attention_modules: Sequence[ModuleSelector], ring_size: int, device_type: str,
                memory_features: memory.MemoryFeatures, fitting: bool) -> None:
        """Validate and switch every model of ``lightning_module`` (a LightningModule, or the module Fabric sets
        up) to its sequence-parallel form (before any compute); every change goes into ``patches``. Each kind of
        model is one adapter (:mod:`lightning_ulysses.models.adapters`): all are found and validated before any is
        prepared."""
        settings = PreparationSettings(context.gradients.sp_size, ring_size, device_type, tuple(attention_modules),
                                       memory_features, context.attention_chunk)
        found: dict[str, list[Module]] = {}
        for adapter in ADAPTERS:
            found[adapter.kind] = adapter.find(lightning_module, settings, found)
        models = found["hf"]
        if not models and not found["cores"] and not found["litgpt"] and settings.sp_size > 1:
            raise ValueError(
                f"UlyssesDeepSpeedStrategy(sp_size={settings.sp_size}) found no Hugging Face PreTrainedModel and no"
                " attention core in the LightningModule, so there is no attention to run over the whole sequence:"
                " each rank would attend only within its own shard and train a different model. Declare your"
                " attention cores with `attention_modules=[...]` (classes or name patterns; see"
                " docs/data-and-training-step.md, 'Your own model'), mark them with `ulysses_attention_core = True`,"
                " or use `sp_size=1`."
            )
        for adapter in ADAPTERS:
            adapter.validate(found[adapter.kind], settings)
        hf_attention.register_attention_functions()
        for model in models:
            ADAPTER_OF["hf"].prepare(model, context, patches, settings)
        # what spans the stage's Hugging Face models: the MoE loss of the global batch, ZeRO-3 leaves, train mode
        patches.enter("transformers: MoE load-balancing loss", moe.exact_load_balancing_loss(models, context))
        if context.zero_stage_3:  # modules calling a submodule per data-dependent loop step: ZeRO-3 leaves
            leaves = [module for module, _ in cross_module_reads.loop_callers_reading_parameters(lightning_module)]
            if leaves:
                undo = _compat.make_zero3_leaf_modules(leaves)
                patches.apply("ZeRO-3: leaf modules", lambda: None, undo)
        if fitting:
            modes = building.train_mode_for_fit(models)
            patches.apply("train mode for fit", lambda: None, lambda: building.restore_modes(modes))
        for adapter in (a for a in ADAPTERS if a.kind != "hf"):
            for model in found[adapter.kind]:
                adapter.prepare(model, context, patches, settings)
        self._found = found
        self._named_parameters = list(lightning_module.named_parameters())  # once: read before every backward
        self.hf_models, self.cores, self.own_roots, self.litgpt = (found["hf"], found["cores"], found["own_roots"],
                                                                   found["litgpt"])
        self.form_check_roots = form_check.own_model_roots(lightning_module, self.cores, models, self.own_roots)
        patches.apply("prepared-model lists", lambda: None, self._forget)

    def _forget(self) -> None:
        self._found = {}
        self._named_parameters = []
        self.hf_models, self.cores, self.own_roots, self.litgpt, self.form_check_roots = [], [], [], [], []

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The prepared module's named parameters (every one; callers filter ``requires_grad``), in its order."""
        return self._named_parameters

    def _prepared(self) -> list[tuple[ModelAdapter, Module]]:
        return [(adapter, model) for adapter in ADAPTERS for model in self._found.get(adapter.kind, [])]

    # ------------------------------------------------------------------------------------------ during a stage
    def reinstall_hooks(self, context: StepContext) -> None:
        """The prepared models' forward pre-hooks again, after Lightning's DeepSpeed inference set-up removed every
        module's hooks (``remove_module_hooks``): without them a call during ``trainer.predict/test/validate`` would
        get positions counted from 0 on every rank."""
        for adapter, model in self._prepared():
            adapter.reinstall_hooks(model, context)

    def check_hooks(self) -> None:
        """Every prepared model still has its call-completion hook (checked before each step: something that clears
        module hooks after the strategy prepared the models would otherwise let shards run as whole sequences)."""
        for adapter, model in self._prepared():
            if not adapter.has_hooks(model):
                raise RuntimeError(
                    f"The forward pre-hook UlyssesDeepSpeedStrategy installed on {type(model).__name__} is gone:"
                    " something removed the module hooks after the strategy prepared the model (Lightning's DeepSpeed"
                    " inference set-up does, and the strategy installs them again after it; a newer Lightning may do"
                    " it elsewhere). Without it the model's calls would get positions of the shard counted from 0."
                    " Please report this with your Lightning version."
                )

    def refuse_unsupported_packing(self, sdpa_per_document: bool) -> None:
        """A batch packs several documents per row: every model's attention must keep them apart."""
        for model in self.hf_models:
            impl = hf_attention.attention_implementation(model)
            if not hf_attention.keeps_documents_apart(impl, sdpa_per_document):
                raise ValueError(hf_attention.packed_documents_error(impl))

    def pad_token_id(self) -> int:
        """The first prepared model's ``pad_token_id`` (what the collate step pads rows with), else 0."""
        for model in self.hf_models:
            pad = getattr(model.config, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return 0

    def check_form(self, batch: Any, context: StepContext, layout: SequenceParallelLayout,
                   device: torch.device) -> bool:
        """The model-form check (:mod:`lightning_ulysses.models.form_check`) on the first step's batch; ``False`` when
        the batch gives nothing to probe with."""
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if context.shard_info is None or not isinstance(ids, torch.Tensor):
            return False
        probe = form_check.build_probe(context.shard_info, ids, layout.geometry, layout.sp_rank, layout.sp_group,
                                       form_check.longest_window(self.hf_models))
        unchecked = form_check.unchecked_lengths(self.hf_models, probe.ids.shape[1])
        if unchecked:
            rank_zero_warn(f"UlyssesDeepSpeedStrategy's model-form check runs a probe of {probe.ids.shape[1]} tokens,"
                           f" shorter than the length thresholds {unchecked} of the model's config, which the"
                           " strategy does not know: what the model does past them is not checked. If the model"
                           " computes them from positions, train a short run against one device at that length.")
        hugging_face, litgpt_models = ADAPTER_OF["hf"], ADAPTER_OF["litgpt"]
        targets = [target for m in self.hf_models for target in hugging_face.probe_targets(m)]
        targets += [(root, form_check.whole_own_call, form_check.sharded_own_call) for root in self.form_check_roots]
        targets += [target for m in self.litgpt for target in litgpt_models.probe_targets(m)]
        rounds = [(targets, probe)]
        if context.shard_info.positions_filled and self.hf_models:  # the batch has no positions: as one device runs it
            numbering = [(m, form_check.whole_hf_call_numbering_itself, form_check.sharded_hf_call)
                         for m, _, _ in targets[:len(self.hf_models)]
                         if not vision_language.is_vision_language_model(m)]  # their positions: vision path
            if numbering:
                rounds.append((numbering, form_check.contiguous_probe(probe)))
        form_check.check_model_form(rounds, context, device, lambda: self.plain(context))
        return True

    @contextmanager
    def plain(self, context: StepContext) -> Iterator[None]:
        """Every prepared model and attention core runs plain (unsharded) inside the block."""
        with ExitStack() as stack:
            for model in self.hf_models:
                stack.enter_context(hf.plain_mode(model, context))
            stack.enter_context(context.plain_calls())
            yield


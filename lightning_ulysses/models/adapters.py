"""The kinds of model the strategy makes sequence-parallel, each behind one protocol (:class:`ModelAdapter`): how its
models are found in a LightningModule, validated before any compute, prepared (every change into the patch stack),
given their hooks back after Lightning removed them, checked to still have them, and run by the model-form check's
probe (whole and sharded).

* :class:`HuggingFaceModels`: transformers' ``PreTrainedModel`` (attention through the attention interface, calls
  completed with the shard's facts, the SP loss, RoPE, MoE, generation, classification, the memory switches, vision
  and mixer families: :mod:`~lightning_ulysses.models.hf` and the modules it uses);
* :class:`LitGPTModels`: LitGPT's ``GPT`` (:mod:`~lightning_ulysses.models.litgpt`);
* :class:`AttentionCores`: the attention cores of the user's own model, declared with ``attention_modules`` or
  ``ulysses_attention_core = True`` (:mod:`~lightning_ulysses.parallel.attention`);
* :class:`PositionTakingRoots`: the outermost modules of the user's own model around those cores whose forward takes
  ``position_ids`` (given the shard's positions when called without them, :mod:`~lightning_ulysses.models.calls`).

:class:`~lightning_ulysses.models.preparation.PreparedModels` runs them in this order (the own roots are found around
the cores found before them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from torch.nn import Module

from lightning_ulysses.models import calls, form_check, generation, hf, litgpt, memory, refusals
from lightning_ulysses.models import sequence_classification
from lightning_ulysses.parallel.attention import (ModuleSelector, find_attention_cores, unwrap_attention_core,
                                                  wrap_attention_core)
from lightning_ulysses.patches import PatchStack
from lightning_ulysses.training.step_context import StepContext

ProbeTarget = tuple[Module, Callable[..., Any], Callable[..., Any]]  # (module, whole call, sharded call)


@dataclass(frozen=True)
class PreparationSettings:
    """What preparing a stage's models needs besides the models and the step context."""

    sp_size: int
    ring_size: int
    device_type: str
    attention_modules: Sequence[ModuleSelector] = ()
    memory_features: memory.MemoryFeatures = field(default_factory=memory.MemoryFeatures)
    attention_chunk: Optional[int] = None  # offload_attention's positions per chunk (None: off)

    def hf_only_switches(self) -> list[str]:
        """The switches on that only Hugging Face models run (the memory switches, ``offload_attention``)."""
        features = self.memory_features
        on = {"tiled_mlp": features.tiled_mlp, "tiled_loss": features.tiled_loss,
              "offload_checkpoints": features.offload_checkpoints,
              "offload_attention": self.attention_chunk is not None}
        return [name for name, value in on.items() if value]


class ModelAdapter:
    """One kind of model (module docstring). ``found`` holds what the adapters before this one found, by kind."""

    kind = ""

    def find(self, root: Module, settings: PreparationSettings, found: dict[str, list[Module]]) -> list[Module]:
        raise NotImplementedError

    def validate(self, models: list[Module], settings: PreparationSettings) -> None:
        """Refuse (a ``ValueError`` naming what to change) what cannot train exactly, before any compute."""

    def prepare(self, model: Module, context: StepContext, patches: PatchStack, settings: PreparationSettings) -> None:
        """Switch ``model`` to its sequence-parallel form; every change into ``patches``."""
        raise NotImplementedError

    def reinstall_hooks(self, model: Module, context: StepContext) -> None:
        """The model's forward pre-hooks again (Lightning's DeepSpeed inference set-up removes every module's)."""

    def has_hooks(self, model: Module) -> bool:
        """Whether the model's call-completion hooks are still registered."""
        return True

    def probe_targets(self, model: Module) -> list[ProbeTarget]:
        """What the model-form check runs whole and sharded for this model."""
        return []


class HuggingFaceModels(ModelAdapter):
    kind = "hf"

    def find(self, root: Module, settings: PreparationSettings, found: dict[str, list[Module]]) -> list[Module]:
        return hf.find_pretrained_models(root)

    def validate(self, models: list[Module], settings: PreparationSettings) -> None:
        for model in models:
            refusals.validate_model(model, settings.sp_size, settings.device_type, settings.ring_size)

    def prepare(self, model: Module, context: StepContext, patches: PatchStack, settings: PreparationSettings) -> None:
        patches.apply(f"{type(model).__name__}: Ulysses attention and SP loss",
                      lambda: hf.prepare_model(model, context), lambda: hf.restore_model(model))
        patches.apply(f"{type(model).__name__}: memory features",
                      lambda: memory.enable(model, settings.memory_features, context), lambda: memory.disable(model))
        patches.apply(f"{type(model).__name__}: plain generate",
                      lambda: generation.install_plain_generate(model, context, context.zero_stage_3),
                      lambda: generation.remove_plain_generate(model))

    def reinstall_hooks(self, model: Module, context: StepContext) -> None:
        hf.reinstall_hooks(model, context)

    def has_hooks(self, model: Module) -> bool:
        return calls.has_call_completion(model)

    def probe_targets(self, model: Module) -> list[ProbeTarget]:
        # a sequence classifier's pooling runs over the whole sequence (sequence_classification.py): its backbone is
        # the part that is sharded, per token
        probed = (sequence_classification.backbone_of(model) if sequence_classification.is_sequence_classifier(model)
                  else model)
        return [(probed, form_check.whole_hf_call, form_check.sharded_hf_call)]


class LitGPTModels(ModelAdapter):
    kind = "litgpt"

    def find(self, root: Module, settings: PreparationSettings, found: dict[str, list[Module]]) -> list[Module]:
        return litgpt.find_litgpt_models(root)

    def validate(self, models: list[Module], settings: PreparationSettings) -> None:
        for model in models:
            refusals.validate_litgpt_model(model, settings.sp_size, settings.ring_size)
        refusals.refuse_hf_only_switches("a LitGPT GPT", models, settings.hf_only_switches())

    def prepare(self, model: Module, context: StepContext, patches: PatchStack, settings: PreparationSettings) -> None:
        patches.apply(f"{type(model).__name__}: LitGPT attention and RoPE",
                      lambda: litgpt.prepare_litgpt(model, context), lambda: litgpt.restore_litgpt(model))

    def reinstall_hooks(self, model: Module, context: StepContext) -> None:
        litgpt.reinstall_hooks(model, context)

    def has_hooks(self, model: Module) -> bool:
        return litgpt.has_hooks(model)

    def probe_targets(self, model: Module) -> list[ProbeTarget]:
        return [(model, form_check.whole_litgpt_call, form_check.sharded_own_call)]


class AttentionCores(ModelAdapter):
    kind = "cores"

    def find(self, root: Module, settings: PreparationSettings, found: dict[str, list[Module]]) -> list[Module]:
        return [module for _, module in find_attention_cores(root, settings.attention_modules)]

    def validate(self, models: list[Module], settings: PreparationSettings) -> None:
        refusals.refuse_hf_only_switches("your own attention cores (attention_modules)", models,
                                         settings.hf_only_switches())
        if models and settings.ring_size > 1:
            raise ValueError(
                f"attention_modules (your own attention cores) are not supported with ring_size={settings.ring_size}"
                " yet: use ring_size=1."
            )

    def prepare(self, model: Module, context: StepContext, patches: PatchStack, settings: PreparationSettings) -> None:
        patches.apply(f"{type(model).__name__}: attention core",
                      lambda: wrap_attention_core(model, context.sp_group, context),
                      lambda: unwrap_attention_core(model))


class PositionTakingRoots(ModelAdapter):
    kind = "own_roots"

    def find(self, root: Module, settings: PreparationSettings, found: dict[str, list[Module]]) -> list[Module]:
        return calls.position_taking_roots(root, found["cores"])

    def prepare(self, model: Module, context: StepContext, patches: PatchStack, settings: PreparationSettings) -> None:
        patches.apply(f"{type(model).__name__}: call completion",
                      lambda: calls.install_call_completion(model, context, hf_model=False),
                      lambda: calls.remove_call_completion(model))

    def reinstall_hooks(self, model: Module, context: StepContext) -> None:
        calls.remove_call_completion(model)
        calls.install_call_completion(model, context, hf_model=False)

    def has_hooks(self, model: Module) -> bool:
        return calls.has_call_completion(model)


ADAPTERS: tuple[ModelAdapter, ...] = (HuggingFaceModels(), LitGPTModels(), AttentionCores(), PositionTakingRoots())
ADAPTER_OF: dict[str, ModelAdapter] = {adapter.kind: adapter for adapter in ADAPTERS}

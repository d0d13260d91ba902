"""The pre-flight memory check: before the first training step computes anything, the plan of that step for the
model being trained (:func:`~lightning_ulysses.plan.plan_memory`, from the model's config, the step's padded length
and batch size, the layout, ZeRO's settings, the optimizer and the weights' dtype) against a budget (the device's
memory, or ``memory_budget``). A step that would not fit stops every rank with the plan and the changes that would
fit, instead of an out-of-memory error in the middle of the step; or, with ``preflight="warn"``, warns.

The check runs where the plan was measured against the run: one Hugging Face causal LM trained (dense, transformers'
fused experts, a hybrid of gated delta nets and attention as Qwen3.5 and Qwen3-Next have, or a vision-language
model with a Qwen-VL-style tower, planned with the batch's image grids; more models, as a frozen reference beside a
policy, an own model, other hybrids, MoE models with separate expert modules or other vision towers: not checked),
with every strategy setting planned (docs/planning.md). Where it does not run, it says why once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from lightning_ulysses.plan.planner import GIB, MemoryPlan, longest_sequence, plan_memory

MODES = ("stop", "warn", "off")


class PreflightMemoryError(RuntimeError):
    """The planned peak of the first step exceeds the budget (raised on every rank before any compute)."""


@dataclass(frozen=True)
class PreflightSettings:
    """What the plan needs besides the model and the batch."""

    sp_size: int
    world_size: int
    stage: int
    precision: str
    optimizer: str
    offload_optimizer: bool
    reduce_bucket_size: int
    persistence_threshold: int
    prefetch_bucket_size: int = 50_000_000  # ZeRO 3's stage3_prefetch_bucket_size
    ring_size: int = 1
    tiled_mlp: Any = 0  # the strategy's memory switches
    tiled_loss: Any = 0
    offload_checkpoints: bool = False
    gradient_checkpointing: bool = False  # the model's own activation checkpointing
    offload_attention: Any = False  # the strategy's Ulysses-Offload

    def plan_arguments(self) -> dict[str, Any]:
        """:func:`~lightning_ulysses.plan.plan_memory`'s keywords for these settings."""
        return dict(sp_size=self.sp_size, world_size=self.world_size, stage=self.stage, precision=self.precision,
                    optimizer=self.optimizer, offload_optimizer=self.offload_optimizer,
                    reduce_bucket_size=self.reduce_bucket_size, persistence_threshold=self.persistence_threshold,
                    prefetch_bucket_size=self.prefetch_bucket_size, ring_size=self.ring_size,
                    tiled_mlp=self.tiled_mlp, tiled_loss=self.tiled_loss,
                    offload_checkpoints=self.offload_checkpoints,
                    gradient_checkpointing=self.gradient_checkpointing, offload_attention=self.offload_attention)


def optimizer_kind(optimizer: Any) -> str:
    """The planner's name for a (possibly wrapped) torch optimizer: its states per parameter."""
    while hasattr(optimizer, "optimizer") and optimizer is not getattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd_momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    return "adamw"  # Adam, AdamW, DeepSpeed's fused/CPU Adam, and anything unknown: the largest states


def precision_of(model: torch.nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true"}.get(dtype, "32-true")


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def not_validated(model: torch.nn.Module) -> Optional[str]:
    """Why the plan is not yet trusted to stop a run of ``model`` (``None``: measured against launched runs: a dense
    decoder, transformers' fused experts, gated-delta-net hybrids, Qwen-VL-style vision-language models): MoE models
    with separate expert modules, hybrids with other mixers, other vision towers."""
    from lightning_ulysses.families.mixers import planned_mixer
    from lightning_ulysses.models.refusals import sequence_mixers
    from lightning_ulysses.models.vision_language import is_vision_language_model

    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    experts = max(((getattr(c, key, 0) or 0) for c in configs if c is not None for key in _EXPERT_KEYS), default=0)
    fused = any(p.ndim == 3 and p.shape[0] == experts for p in model.parameters())
    if experts > 1 and not fused:
        # transformers' fused experts (one [E, ...] tensor) are traced exactly (their memory depends on how many
        # picks there are, not which); experts as separate modules skipped when no token picks them are not
        return "mixture-of-experts models with separate expert modules are not yet measured against the plan"
    if is_vision_language_model(model) and not hasattr(getattr(model, "model", None), "visual"):
        return "vision-language models other than Qwen-VL-style towers are not yet planned"
    unmeasured = sorted({type(mixer).__name__ for mixer in sequence_mixers(model) if not planned_mixer(mixer)})
    if unmeasured:
        return f"hybrid models with {', '.join(unmeasured)} layers are not yet measured against the plan"
    return None


def not_validated_on(device: torch.device, offload_attention: Any) -> Optional[str]:
    """Why the plan is not yet trusted to stop a run with these switches on ``device`` (``None``: measured).
    ``offload_attention`` on CUDA: its one GPU measurement (an H100, bf16, with the ALST switches) put a checkpointed
    layer's backward 2.3 GB over the plan, on a version of the switch since changed (docs/planning.md); until a GPU
    run measures it again the check does not stop such a run."""
    if device.type == "cuda" and offload_attention:
        return "offload_attention on CUDA is not yet measured against the plan (docs/planning.md)"
    return None


def device_budget(device: torch.device) -> Optional[int]:
    """What this rank's tensors could use: free device memory plus what torch's caching allocator holds (reusable)
    (``None`` on CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _changes_that_fit(config: Any, seq_len: int, batch_size: int, settings: PreflightSettings, budget: int,
                      plan: Callable[..., MemoryPlan], vision_grids: Optional[list] = None) -> list[str]:
    base = dict(settings.plan_arguments(), micro_batch=batch_size, vision_grids=vision_grids)
    candidates = []
    sp = settings.sp_size * 2
    while sp <= settings.world_size:
        if settings.world_size % sp == 0:
            candidates.append((f"sp_size={sp}", dict(base, sp_size=sp)))
        sp *= 2
    if settings.stage < 3:
        candidates.append(("stage=3", dict(base, stage=3)))
    if not settings.offload_optimizer:
        candidates.append(("offload_optimizer=True", dict(base, offload_optimizer=True)))
    if settings.stage in (1, 2) and settings.reduce_bucket_size > 50_000_000:  # two buckets per rank at ZeRO 1/2
        candidates.append(("reduce_bucket_size=5e7 (a strategy argument)", dict(base, reduce_bucket_size=50_000_000)))
    if not (settings.tiled_mlp and settings.tiled_loss and settings.offload_checkpoints):
        candidates.append(("the ALST switches (tiled_mlp='auto', tiled_loss='auto', offload_checkpoints=True)",
                           dict(base, tiled_mlp="auto", tiled_loss="auto", offload_checkpoints=True)))
    if batch_size > 1:
        candidates.append(("a micro-batch of 1 row", dict(base, micro_batch=1)))
    fits = []
    for label, settings_ in candidates:
        try:
            peak = plan(config, seq_len, **settings_).peak
        except ValueError:
            continue  # not a valid layout for this model (heads)
        if peak <= budget:
            fits.append(f"{label} (peak {peak / GIB:.1f} GiB)")
    longest = longest_sequence(config, budget, **base)
    if longest:
        fits.append(f"rows of at most {longest} tokens with these settings")
    return fits


def check_first_step(config: Any, seq_len: int, batch_size: int, settings: PreflightSettings, budget: int,
                     agree: Callable[[bool], bool], mode: str, warn: Callable[[str], None],
                     vision_grids: Optional[list] = None) -> Optional[MemoryPlan]:
    """Plan the step; if its peak exceeds ``budget`` on any rank (``agree``: the OR over all ranks), raise
    :class:`PreflightMemoryError` (``mode="stop"``) or warn (``"warn"``). Returns the plan. ``vision_grids``: the
    batch's images and videos (a vision-language model's, ``(t, h, w)`` each)."""
    plan = plan_memory(config, seq_len, micro_batch=batch_size, vision_grids=vision_grids,
                       **settings.plan_arguments())
    if not agree(plan.peak > budget):
        return plan
    fits = _changes_that_fit(config, seq_len, batch_size, settings, budget, plan_memory, vision_grids)
    message = (f"UlyssesDeepSpeedStrategy's pre-flight check: the first training step is planned at"
               f" {plan.peak / GIB:.2f} GiB per rank, more than the {budget / GIB:.2f} GiB budget (on at least one"
               f" rank); nothing was computed.\n{plan.table()}\nChanges that fit: "
               + ("; ".join(fits) if fits else "none of sp_size, stage=3, offload_optimizer alone")
               + ". The plan counts what the step allocates from the model's shapes (docs/planning.md); pass"
               " `preflight=\"warn\"` to train anyway, or `memory_budget=` for another budget.")
    if mode == "stop":
        raise PreflightMemoryError(message)
    warn(message)
    return plan


__all__ = ["MODES", "PreflightMemoryError", "PreflightSettings", "check_first_step", "device_budget",
           "not_validated", "not_validated_on", "optimizer_kind", "precision_of"]

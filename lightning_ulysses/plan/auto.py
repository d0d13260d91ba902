"""``sp_size="auto"``: the strategy picks the SP group size from the memory plan of the model it is about to train.

Once the model is known (the Trainer: after ``configure_model``, before DeepSpeed's engine is built; Fabric: at
``fabric.setup(model, ...)``), :func:`choose_sp_size` asks :func:`~lightning_ulysses.plan.recommend` for the sizes
that fit a per-rank budget with the run's own settings (its ZeRO stage, precision, memory switches, optimizer offload,
micro-batch, the ``sequence_length`` given) and takes the quickest by the step-time estimate: usually the smallest
size that fits (more data-parallel replicas, fewer exchanged bytes). Nothing fits: every rank stops before any weight
is touched, with the settings that would fit.

The budget is ``memory_budget`` or the smallest free device memory over the ranks (every rank must choose the same
size); on CPU there is no device memory to read, so ``memory_budget`` is required there. The optimizer is not known yet
when the size is chosen: the plan counts Adam's states (the largest), so an SGD run has room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_ulysses.plan.cost import Recommendation, recommend

AUTO = "auto"

_DEVICE_NAMES = {"H200": "h200", "H100": "h100", "A100": "a100", "B200": "b200"}


@dataclass(frozen=True)
class AutoSettings:
    """What the run fixes besides the SP size (read from the strategy when the size is chosen)."""

    sequence_length: int
    devices_per_node: int
    nodes: int
    budget_bytes: int
    precision: str
    stage: int
    memory_switches: bool
    offload_optimizer: bool
    micro_batch: int
    device_name: str = ""  # the accelerator's name (CUDA's), for the step-time estimate's preset


def device_preset(device_name: str) -> str:
    """The planner's device preset for an accelerator name (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``); H100 for
    anything else (CPU included): the preset only ranks the sizes that fit, the budget decides what fits."""
    return next((preset for key, preset in _DEVICE_NAMES.items() if key in device_name.upper()), "h100")


def planned_model_config(module: nn.Module) -> Any:
    """The config of the one Hugging Face model ``module`` trains (``ValueError`` naming what to do otherwise)."""
    from transformers import PreTrainedModel

    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    outermost = [m for m in models if not any(m is not o and any(m is s for s in o.modules()) for o in models)]
    if len(outermost) != 1:
        raise ValueError(
            f"UlyssesDeepSpeedStrategy(sp_size='auto') plans for one Hugging Face PreTrainedModel, and the module holds"
            f" {len(outermost)} ({', '.join(type(m).__name__ for m in outermost) or 'none'}). Choose the size with"
            " `python -m lightning_ulysses.plan --recommend ...` (docs/planning.md) and pass it as `sp_size=N`."
        )
    return outermost[0].config


def choose_sp_size(config: Any, settings: AutoSettings) -> Recommendation:
    """The quickest SP size that fits ``settings.budget_bytes`` with the run's own settings; ``ValueError`` with
    the settings that would fit (any stage, switches or offload) when none does."""
    common = dict(devices_per_node=settings.devices_per_node, nodes=settings.nodes,
                  device=device_preset(settings.device_name), budget_bytes=settings.budget_bytes,
                  precision=settings.precision, micro_batch=settings.micro_batch, optimizer="adamw")
    fitting = recommend(config, settings.sequence_length, stages=(settings.stage,),
                        memory_switches=(settings.memory_switches,), offload_optimizer=(settings.offload_optimizer,),
                        **common)
    if fitting:
        return fitting[0]
    others = recommend(config, settings.sequence_length, **common)
    shown = "; ".join(f"{r.strategy_arguments()} (peak {r.plan.peak / 2**30:.2f} GiB)" for r in others[:4])
    raise ValueError(
        f"UlyssesDeepSpeedStrategy(sp_size='auto') found no SP size that fits {settings.sequence_length} tokens per"
        f" row in {settings.budget_bytes / 2**30:.2f} GiB per rank on {settings.nodes * settings.devices_per_node}"
        f" devices with ZeRO {settings.stage}, {settings.precision}, memory switches"
        f" {'on' if settings.memory_switches else 'off'}, optimizer offload"
        f" {'on' if settings.offload_optimizer else 'off'}; nothing was loaded onto the device. "
        + (f"These settings would fit: {shown}." if shown else
           "No setting the planner knows fits: a shorter sequence_length, more devices, or a larger memory_budget.")
    )


def describe(choice: Recommendation, settings: AutoSettings) -> str:
    """The line logged on rank zero."""
    return (f"UlyssesDeepSpeedStrategy(sp_size='auto') chose sp_size={choice.sp_size} for {settings.sequence_length}"
            f" tokens per row on {settings.nodes * settings.devices_per_node} devices: planned peak"
            f" {choice.plan.peak / 2**30:.2f} GiB per rank of a {settings.budget_bytes / 2**30:.2f} GiB budget"
            f" (ZeRO {settings.stage}, {settings.precision}), estimated {choice.tokens_per_second:,.0f} tokens/s on"
            f" {device_preset(settings.device_name)}-class devices.")


def budget_error() -> str:
    return ("UlyssesDeepSpeedStrategy(sp_size='auto') needs a per-rank memory budget to plan against: on CPU there is"
            " no device memory to read. Pass `memory_budget=<bytes per rank>`.")


def smallest_over_ranks(value: Optional[int], device: Any) -> Optional[int]:
    """The smallest ``value`` over all ranks (every rank must choose the same size), ``None`` if any rank has none."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    flag = torch.tensor([value if value is not None else -1], dtype=torch.int64, device=device)
    both = torch.cat([flag, -flag])  # [2]: MAX gives the largest and -smallest
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    smallest = -int(both[1])
    return None if smallest < 0 else smallest

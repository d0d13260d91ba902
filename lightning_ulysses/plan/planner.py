"""The plan: per-rank peak memory of a training step under :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy`,
with its parts, for a Hugging Face causal LM's config, a sequence length and the strategy's settings, before any
process starts or any weight is built; and the longest sequence that fits a budget.

Peak per rank = the model's states (:mod:`lightning_ulysses.plan.states`) + the step's own allocations at their peak
(:mod:`lightning_ulysses.plan.activations`: activations, logits and loss, gradients in flight, ZeRO's buckets,
counted from shapes on the meta device) + at ZeRO 3 the gathered parameters in flight + the device's fixed cost
(``reserved_bytes``: anything else a user sets aside, 0 by default). A device preset's budget is its memory less
what a process holds outside torch's allocator (:attr:`Device.tensor_bytes`: the CUDA context, cuBLAS, NCCL;
measured on an H100).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from lightning_ulysses.parallel.offload_attention import chunk_length
from lightning_ulysses.plan.activations import (is_litgpt_config, rank_vision_units, trace_litgpt_step,
                                                trace_step)
from lightning_ulysses.plan.states import ModelStates, model_states

PRECISIONS = {"32-true": torch.float32, "32": torch.float32, "bf16-mixed": torch.bfloat16,
              "bf16-true": torch.bfloat16, "16-mixed": torch.float16, "16-true": torch.float16}
GIB = 2**30


# What a training process holds on a GPU outside torch's caching allocator: the CUDA context, cuBLAS's handles and
# NCCL's communicator. Measured on an H100 (torch 2.11 + CUDA 13.0, DeepSpeed's ZeRO 2 engine, one rank): 1329-1337 MiB
# at the end of three training runs (total - free - memory_reserved; benchmarks/results/gpu/report.md). NCCL's buffers
# grow with the communicators a run makes across ranks: not measured (one GPU lent).
CUDA_FIXED_BYTES = 1337 * 2**20


@dataclass(frozen=True)
class Device:
    """A device's memory (what ``nvidia-smi`` reports as total), its dense bf16 rate, and what a process holds on it
    outside torch's allocator (``fixed_bytes``, :data:`CUDA_FIXED_BYTES`: measured on an H100, taken for the others)."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fixed_bytes: int = CUDA_FIXED_BYTES

    @property
    def tensor_bytes(self) -> int:
        """What a rank's tensors can use: the memory less the fixed cost (the budget of a plan for this device)."""
        return self.memory_bytes - self.fixed_bytes


DEVICES = {
    "h100": Device("NVIDIA H100 80GB HBM3", 81559 * 2**20, 989e12),  # memory: read on an H100 here (KINDS.md)
    "h200": Device("NVIDIA H200", 143771 * 2**20, 989e12),  # read on an H200 here
    "a100-80gb": Device("NVIDIA A100 80GB", 81920 * 2**20, 312e12),
    "a100-40gb": Device("NVIDIA A100 40GB", 40960 * 2**20, 312e12),
    "b200": Device("NVIDIA B200", 183359 * 2**20, 2250e12),
}


# the tracker's kinds, as a plan names them (at the step's peak)
_STEP_PARTS = {"saved for backward": "activations saved for backward",
               "gradients and optimizer": "gradients in flight (activations' and weights'), ZeRO buckets",
               "logits and loss": "logits and loss", "exchange buffers": "exchange buffers",
               "temporaries": "temporaries", "masks": "masks", "positions and indices": "positions and indices"}


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted peak, in bytes, and its parts (see the module doc)."""

    seq_len: int
    sp_size: int
    world_size: int
    stage: int
    precision: str
    micro_batch: int
    states: ModelStates
    step: int
    step_by_kind: dict[str, int] = field(default_factory=dict)
    zero3_gathered: int = 0
    reserved: int = 0
    parameters: int = 0
    host_checkpoints: int = 0  # host bytes per rank the offloaded checkpoints (and attention chunks) hold at most
    ring_size: int = 1

    @property
    def peak(self) -> int:
        return self.states.total + self.step + self.zero3_gathered + self.reserved

    def parts(self) -> list[tuple[str, int]]:
        rows = [("parameters", self.states.parameters),
                ("ZeRO float32 copies (master weights; at ZeRO 3 also gradients)", self.states.master_and_gradients),
                ("optimizer states", self.states.optimizer)]
        if self.states.buffers:
            rows.append(("ZeRO-3 reduce bucket", self.states.buffers))
        rows += [(f"step: {_STEP_PARTS.get(kind, kind)}", size) for kind, size in sorted(self.step_by_kind.items())
                 if size]
        if self.zero3_gathered:
            rows.append(("ZeRO-3 gathered parameters in flight", self.zero3_gathered))
        if self.reserved:
            rows.append(("device fixed cost (reserved_bytes)", self.reserved))
        return rows

    def table(self) -> str:
        ring = f" (ring {self.ring_size})" if self.ring_size > 1 else ""
        head = (f"S={self.seq_len}, sp={self.sp_size}{ring}, {self.world_size} ranks, ZeRO {self.stage}, {self.precision},"
                f" micro-batch {self.micro_batch}, {self.parameters / 1e9:.2f} B parameters")
        lines = [head, "| part | GiB per rank |", "|---|---|"]
        lines += [f"| {name} | {size / GIB:.2f} |" for name, size in self.parts()]
        lines.append(f"| **peak** | **{self.peak / GIB:.2f}** |")
        if self.states.host or self.host_checkpoints:
            lines.append(f"(host memory per rank: {self.states.host / GIB:.2f} GiB for the offloaded states,"
                         f" {self.host_checkpoints / GIB:.2f} GiB for the offloaded checkpoints)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["peak"] = self.peak
        return found


def _validate(config: Any, seq_len: int, sp_size: int, world_size: int, ring_size: int = 1) -> None:
    if seq_len < 1 or sp_size < 1 or world_size < 1 or ring_size < 1:
        raise ValueError("seq_len, sp_size, world_size and ring_size must be positive.")
    if world_size % sp_size:
        raise ValueError(f"world_size {world_size} is not a multiple of sp_size {sp_size}.")
    if sp_size % ring_size:
        raise ValueError(f"sp_size {sp_size} is not a multiple of ring_size {ring_size}.")
    ulysses = sp_size // ring_size
    text = getattr(config, "text_config", None) or config  # a vision-language model's language model
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads and heads % ulysses:
        raise ValueError(f"{heads} attention heads do not split over {ulysses} Ulysses ranks (sp_size={sp_size},"
                         f" ring_size={ring_size}): choose a Ulysses size (sp_size / ring_size) that divides the"
                         " heads (past that, a larger ring_size).")
    if kv_heads and ulysses > kv_heads and ulysses % kv_heads:
        raise ValueError(f"{kv_heads} KV heads: sp_size / ring_size = {ulysses} must divide them or be a multiple"
                         " of them.")


def plan_memory(config: Any, seq_len: int, *, sp_size: int = 1, world_size: Optional[int] = None, stage: int = 2,
                precision: str = "bf16-mixed", micro_batch: int = 1, optimizer: str = "adamw",
                offload_optimizer: bool = False, reduce_bucket_size: int = 200_000_000,
                persistence_threshold: int = 100_000, reserved_bytes: int = 0, tiled_mlp: Any = 0,
                tiled_loss: Any = 0, offload_checkpoints: bool = False,
                gradient_checkpointing: bool = False, ring_size: int = 1,
                offload_parameters: bool = False, prefetch_bucket_size: int = 50_000_000,
                vision_grids: Optional[list[tuple[int, int, int]]] = None,
                offload_attention: Any = False) -> MemoryPlan:
    """Predict one rank's peak memory for training a Hugging Face causal LM built from ``config`` (a
    ``PretrainedConfig``, or a built model: its config; or LitGPT's ``GPT`` from a ``litgpt.config.Config`` or a built
    ``GPT``, planned as the strategy runs it: Ulysses attention, LitGPT's cross-entropy over the logits) on rows of
    ``seq_len`` tokens with ``UlyssesDeepSpeedStrategy(sp_size=sp_size, stage=stage)`` on ``world_size`` ranks
    (default: ``sp_size``). ``precision``: Lightning's (``"bf16-mixed"`` and ``"bf16-true"`` both train bf16 weights
    under DeepSpeed); ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"`` or
    ``"sgd_momentum"``; ``reduce_bucket_size``: DeepSpeed's (Lightning's default 2e8 elements). Attention is counted
    as a flash kernel keeps it (no ``[S, S]`` scores). ``tiled_mlp``, ``tiled_loss``, ``offload_checkpoints``: the
    strategy's memory switches (run by the strategy's own code in the trace; the offload as on an accelerator);
    ``gradient_checkpointing``: the model's ``gradient_checkpointing_enable()``; ``ring_size``: the strategy's (hybrid
    Ulysses × ring: the strategy's own ring attention runs in the trace); ``offload_parameters``: ZeRO 3's
    ``offload_param`` to the CPU (the partitioned parameters in host memory; modeled, not measured);
    ``prefetch_bucket_size``: ZeRO 3's ``stage3_prefetch_bucket_size`` (DeepSpeed's default 5e7 elements);
    ``vision_grids``: for a vision-language ``config`` (Qwen-VL-style towers), a row's images and videos as the
    processor's ``(t, h, w)`` grids in patches (their features are among the ``seq_len`` tokens; the strategy deals
    the units to the SP ranks, the busiest rank's are planned); ``offload_attention``: the strategy's (the chunks of
    each layer's attention in host memory, as on CUDA). About a second for an 8B model."""
    world_size = world_size or sp_size
    if isinstance(config, torch.nn.Module):  # a built Hugging Face model: its config (nothing of it is touched)
        if not hasattr(config, "config"):
            raise ValueError(f"plan_memory takes a Hugging Face config or model; a {type(config).__name__} has no"
                             " .config to plan from.")
        config = config.config
    _validate(config, seq_len, sp_size, world_size, ring_size)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}.")
    litgpt = is_litgpt_config(config)
    if litgpt:
        _validate_litgpt(config, seq_len, sp_size, ring_size, tiled_mlp=tiled_mlp, tiled_loss=tiled_loss,
                         offload_checkpoints=offload_checkpoints, gradient_checkpointing=gradient_checkpointing,
                         offload_attention=offload_attention, vision_grids=vision_grids)
    dtype = PRECISIONS[precision]
    param_bytes = torch.finfo(dtype).bits // 8
    pad = sp_size if ring_size == 1 else 2 * sp_size  # rows padded to a multiple of sp (2·sp: the ring's zigzag)
    shard = math.ceil(seq_len / pad) * pad // sp_size
    buckets = 2 * reduce_bucket_size * param_bytes if stage in (1, 2) else 0  # ZeRO 1/2: two, from the first gradient
    traced = trace_litgpt_step(config, shard, micro_batch, dtype, sp_size, gradient_buffer_bytes=buckets,
                               gradients_leave=stage >= 1) if litgpt else trace_step(
                        config, shard, micro_batch, dtype, sp_size, gradient_buffer_bytes=buckets,
                        gradients_leave=stage >= 1, tiled_mlp=tiled_mlp, tiled_loss=tiled_loss,
                        offload_checkpoints=offload_checkpoints, gradient_checkpointing=gradient_checkpointing,
                        ring=ring_size,
                        vision_units=rank_vision_units(vision_grids, sp_size) if vision_grids else None,
                        attention_chunk=chunk_length(offload_attention))
    states = model_states(traced.numels, traced.trainable, world_size, stage, param_bytes, optimizer,
                          offload_optimizer, persistence_threshold, reduce_bucket_size, offload_parameters)
    step, by_kind = traced.peak, dict(traced.by_kind)
    if stage in (1, 2):
        # ZeRO 1/2's optimizer step, after the backward pass (deepspeed/runtime/zero/stage_1_and_2.py, step()): this
        # rank's gradient partition in the training dtype, its flattened copy and, in 16 bits, its float32 copy: the
        # step's peak where the parameters outweigh the activations. The reduce buckets are released at the end of
        # the backward pass (the epilogue's _release_ipg_buffers), except that in float32 across ranks the step holds
        # about their size again. Measured (TensorMemoryMonitor on CPU, bucket 2e7, 99 M parameters; CUDA's
        # max_memory_allocated on an H100 and an H200): bf16 at 1 and 2 ranks and float32 at 1 rank equal to the
        # partitions alone within 1.1%, float32 at 2 ranks +1.5% with the buckets (without them -28%).
        partition = traced.trainable // world_size
        held_buckets = buckets if param_bytes == 4 and world_size > 1 else 0
        optimizer_phase = held_buckets + 2 * partition * param_bytes + (4 * partition if param_bytes != 4 else 0)
        if optimizer_phase > step:
            step, by_kind = optimizer_phase, {"optimizer step (ZeRO gradient partitions, buckets)": optimizer_phase}
    gathered = (zero3_gathered_elements(traced.module_numels, persistence_threshold, prefetch_bucket_size)
                * param_bytes if stage == 3 else 0)
    return MemoryPlan(seq_len, sp_size, world_size, stage, precision, micro_batch, states, step, by_kind, gathered,
                      reserved_bytes, traced.parameters, traced.host, ring_size)


def _validate_litgpt(config: Any, seq_len: int, sp_size: int, ring_size: int, **switches: Any) -> None:
    """What the strategy refuses for a LitGPT ``GPT`` (:func:`~lightning_ulysses.models.refusals.validate_litgpt_model`
    and the switches Hugging Face models alone run), refused here before planning it."""
    if ring_size > 1:
        raise ValueError("LitGPT models are supported with ring_size=1 (Ulysses) only.")
    if config.n_head < sp_size:
        raise ValueError(f"A LitGPT model with n_head={config.n_head} has fewer heads than sp_size={sp_size}.")
    if seq_len > config.block_size:
        raise ValueError(f"seq_len {seq_len} is longer than the LitGPT config's block_size {config.block_size} (its"
                         " RoPE cache's rows, which the strategy reads at the shard's global positions): set block_size"
                         " to the sequence length at least.")
    if getattr(config, "sliding_window_size", None):
        raise ValueError("LitGPT models with sliding-window layers are not supported under sequence parallelism yet.")
    on = [name for name, value in switches.items() if value]
    if on:
        raise ValueError(f"{', '.join(on)}: run inside Hugging Face models only; the strategy refuses them for a"
                         " LitGPT GPT.")


def zero3_gathered_elements(module_numels: tuple[tuple[int, ...], ...], persistence_threshold: int,
                            prefetch_bucket_size: int, max_live_parameters: int = 1_000_000_000) -> int:
    """The most parameter elements ZeRO 3 holds gathered at once: a module's own partitioned parameters (those at or
    over ``persistence_threshold`` elements; the others stay whole on every rank, counted with the states) while it
    runs, plus the parameters it prefetches for the modules after it, in the order of the pass (forward: the model's
    order; backward: reversed), one parameter at a time until ``prefetch_bucket_size`` elements are in flight
    (``deepspeed/runtime/zero/partitioned_param_coordinator.py``, ``fetch_sub_module``). On a small model the whole
    model is in flight; on an 8B one, the LM head (or embedding) and a layer's worth of prefetched weights."""
    modules = [m for m in ([n for n in numels if n >= persistence_threshold] for numels in module_numels) if m]
    worst = 0
    for ordered in (modules, modules[::-1]):
        flat = [n for m in ordered for n in m]  # the parameters in the order the pass fetches them
        position = 0
        for m in ordered:
            current = sum(m)
            position += len(m)
            limit = min(prefetch_bucket_size, max_live_parameters - current)
            fetched, j = 0, position
            while j < len(flat) and fetched < limit:
                fetched += flat[j]
                j += 1
            worst = max(worst, current + fetched)
    return worst


def longest_sequence(config: Any, budget_bytes: int, *, multiple: int = 1024, max_len: int = 1 << 27,
                     host_budget_bytes: Optional[int] = None, **settings: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``multiple`` and of ``sp_size``) whose planned peak fits
    ``budget_bytes``, 0 if none does; ``settings`` as :func:`plan_memory`'s. ``host_budget_bytes``: also the host
    memory per rank that the offloaded states and checkpoints may take (with the ALST switches a long sequence's
    checkpoints can outgrow a node's memory before the device's: Llama-3.1-8B at 1.16M tokens on one H100 keeps 302
    GiB of them). The peak grows linearly with the shard within each phase of the step (flash attention): secant
    steps find the answer in a few plans."""
    sp = settings.get("sp_size", 1)
    step = multiple * sp // math.gcd(multiple, sp)
    peaks: dict[int, int] = {}
    scale = 1.0 if host_budget_bytes is None else budget_bytes / max(host_budget_bytes, 1)

    def peak(length: int) -> int:
        """The planned device peak, or the host bytes in the device budget's scale where they are over theirs."""
        if length not in peaks:
            plan = plan_memory(config, length, **settings)
            host = plan.states.host + plan.host_checkpoints
            over_host = host_budget_bytes is not None and host > host_budget_bytes
            peaks[length] = max(plan.peak, int(host * scale)) if over_host else plan.peak
        return peaks[length]

    if peak(step) > budget_bytes:
        return 0
    last, current = step, 4 * step
    for _ in range(8):
        slope = (peak(current) - peak(last)) / (current - last)
        if slope <= 0:
            break
        guess = current + (budget_bytes - peak(current)) / slope
        guess = min(guess, 8 * current)  # at most 8x per plan: a trace's cost grows with the tile counts
        guess = min(max(int(guess) // step * step, step), max_len // step * step)
        if guess in peaks:
            break
        last, current = current, guess
    best = max((length for length, value in peaks.items() if value <= budget_bytes), default=step)
    while best + step <= max_len and peak(best + step) <= budget_bytes:
        best += step
    return best

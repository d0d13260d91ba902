"""What a training step costs besides memory: its FLOPs and the bytes each rank exchanges, a step-time estimate from
a device's rate and links, and a recommendation: the setting that fits with the highest estimated throughput.

The FLOPs of one step of a dense decoder (``B`` rows of ``S`` tokens per replica, ``L`` layers): every matmul weight
``N`` (attention projections, the gated MLP, the LM head) costs ``6 · N · B·S`` (forward 2, backward 4); attention's
scores and values ``12 · B · Hq · D · S² · L · f`` (two matmuls of ``2 · S² · D`` per head forward, twice that
backward) with ``f = 1/2`` for a causal kernel that skips the masked blocks (flash) and 1 for one that computes every
score (eager attention, PyTorch's math SDPA). Sequence parallelism divides a replica's step
evenly: each of its ``sp`` ranks runs the matmuls of ``S/sp`` tokens and attention for ``Hq/sp`` heads over all ``S``.

Bytes sent per rank and step: Ulysses's all-to-alls, forward and backward, ``2 · B·(S/sp)·(2·Hq + 2·Hkv)·D`` elements
per layer, of which ``(sp - 1)/sp`` leave the rank; ZeRO's gradient reduce-scatter and parameter all-gather over all
``W`` ranks, ``2 · N_all · (W - 1)/W`` elements (ZeRO 3: ``3 ·``, the parameters gathered for backward too). With
``ring_size = R`` the all-to-alls run among ``U = sp/R`` ranks, and ring attention passes each rank's K/V block
(``2 · B·(S/R)·(Hkv/U)·D`` elements) ``R - 1`` times forward and again backward, and the block's float32 key/value
gradients ``R`` times.

The step-time estimate is compute at ``efficiency`` of the device's dense bf16 rate, plus the all-to-alls at the link
of the SP group (inside a node while ``sp`` divides the devices per node), plus ZeRO's traffic at the slowest link of
the world, with no overlap: an upper bound for ranking settings against each other, not a promise of a step time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from lightning_ulysses.plan.planner import DEVICES, PRECISIONS, Device, MemoryPlan, _validate, plan_memory
from lightning_ulysses.plan.activations import is_litgpt_config

# per device, bytes per second and direction: NVLink inside a node, the network between nodes (one 400 Gb/s NIC each)
LINKS = {"h100": (450e9, 50e9), "h200": (450e9, 50e9), "a100-80gb": (300e9, 25e9), "a100-40gb": (300e9, 25e9),
         "b200": (900e9, 50e9)}


@dataclass(frozen=True)
class StepCost:
    """One rank's work in one training step."""

    flops: float  # per rank
    all_to_all_bytes: float  # sent per rank (Ulysses's exchanges, forward and backward)
    zero_bytes: float  # sent per rank (ZeRO's gradient and parameter collectives)
    ring_bytes: float = 0.0  # sent per rank (ring attention's K/V blocks and their gradients, ring_size > 1)


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k")


def experts_of(config: Any) -> tuple[int, int]:
    """``(experts, picked per token)`` of a mixture-of-experts config; ``(0, 0)`` for a dense one."""
    experts = next((int(v) for key in _EXPERT_KEYS if isinstance(v := getattr(config, key, None), int) and v > 1), 0)
    if not experts:
        return 0, 0
    top_k = next((int(v) for key in _TOP_K_KEYS if isinstance(v := getattr(config, key, None), int) and v > 0), 0)
    if not top_k:
        raise ValueError(f"The step cost needs the experts picked per token of this mixture-of-experts config"
                         f" ({experts} experts; none of {_TOP_K_KEYS} is set).")
    return experts, top_k


def _sizes(config: Any) -> tuple[int, int, int, int, int, int, int]:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return hidden, layers, heads, kv_heads, head_dim, config.intermediate_size, config.vocab_size


def matmul_parameters(config: Any) -> int:
    """The weights of every matmul of a step, as many as one token multiplies with: attention projections and gated
    MLP per layer, and the LM head; for a mixture of experts the weights of the experts a token picks (``top_k`` of
    ``E``: each fused expert tensor counted ``top_k / E``), the router and the shared experts, from the model built
    on the meta device."""
    if experts_of(config)[0]:
        return _active_matmul_parameters(config)
    h, layers, hq, hkv, d, inter, vocab = _sizes(config)
    per_layer = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter
    return layers * per_layer + h * vocab


def _active_matmul_parameters(config: Any) -> int:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    experts, top_k = experts_of(config)
    config = copy.deepcopy(config)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    total = head.weight.numel() if head is not None else 0
    seen = {id(head.weight)} if head is not None else set()
    for p in model.parameters():
        if id(p) in seen or id(p) in embeddings or p.ndim < 2:
            continue
        seen.add(id(p))
        fused_experts = p.ndim == 3 and p.shape[0] == experts
        total += p.numel() * top_k // experts if fused_experts else p.numel()
    return total


def step_cost(config: Any, seq_len: int, *, sp_size: int = 1, world_size: Optional[int] = None, stage: int = 2,
              precision: str = "bf16-mixed", micro_batch: int = 1, attention_fraction: float = 0.5,
              recompute: bool = False, parameters: Optional[int] = None, ring_size: int = 1) -> StepCost:
    """One rank's FLOPs and bytes sent in a training step (module docstring). ``recompute``: the layers' forward runs
    again in backward (activation checkpointing, the strategy's ``offload_checkpoints``); ``parameters``: every
    trainable weight (ZeRO's traffic; default: the matmul weights plus the embedding); ``ring_size``: the strategy's.
    A vision-language model's step counts its language model (the vision tower's FLOPs are not added)."""
    world_size = world_size or sp_size
    if is_litgpt_config(config):
        raise ValueError("The step cost reads Hugging Face configs; for a LitGPT model only its memory is planned.")
    _validate(config, seq_len, sp_size, world_size, ring_size)
    if getattr(config, "vision_config", None) is not None:  # a vision-language model: its language model's step
        config = config.text_config
    h, layers, hq, hkv, d, inter, vocab = _sizes(config)
    tokens = micro_batch * seq_len
    dense = (6 + (2 if recompute else 0)) * matmul_parameters(config) * tokens
    attention = (12 + (4 if recompute else 0)) * micro_batch * hq * d * seq_len ** 2 * layers * attention_fraction
    element = PRECISIONS[precision].itemsize
    shard = micro_batch * -(-seq_len // sp_size)
    ulysses = sp_size // ring_size
    all_to_all = 2 * shard * (2 * hq + 2 * hkv) * d * layers * (ulysses - 1) / ulysses * element
    block = 2 * micro_batch * -(-seq_len // ring_size) * max(hkv / ulysses, 1) * d  # a K/V block's elements
    ring = (ring_size - 1) * 2 * block * element + ring_size * block * 4 if ring_size > 1 else 0.0
    total = parameters if parameters is not None else matmul_parameters(config) + h * vocab
    zero = (3 if stage == 3 else 2) * total * (world_size - 1) / world_size * element if world_size > 1 else 0.0
    return StepCost((dense + attention) / sp_size, all_to_all, zero, ring * layers)


def step_seconds(cost: StepCost, device: Device, *, sp_size: int, devices_per_node: int, nodes: int = 1,
                 efficiency: float = 0.5, links: Optional[tuple[float, float]] = None) -> float:
    """The step-time estimate (module docstring): ``links`` is (inside a node, between nodes) in bytes per second
    per direction (default: :data:`LINKS` of the device)."""
    intra, inter = links or LINKS.get(_device_key(device), (450e9, 50e9))
    sp_link = intra if devices_per_node % sp_size == 0 else inter
    zero_link = inter if nodes > 1 else intra
    return (cost.flops / (device.bf16_flops * efficiency) + (cost.all_to_all_bytes + cost.ring_bytes) / sp_link
            + cost.zero_bytes / zero_link)


def _device_key(device: Device) -> str:
    return next((key for key, known in DEVICES.items() if known == device), "")


@dataclass(frozen=True)
class Recommendation:
    """A setting that fits, with its plan and its step-time estimate."""

    sp_size: int
    stage: int
    memory_switches: bool  # tiled MLP and loss ("auto") and offloaded checkpoints
    offload_optimizer: bool
    plan: MemoryPlan
    seconds: float  # the step-time estimate
    tokens_per_second: float  # of the whole world: dp replicas x micro-batch x seq_len per step

    def strategy_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``UlyssesDeepSpeedStrategy`` for this setting."""
        arguments: dict[str, Any] = {"sp_size": self.sp_size, "stage": self.stage}
        if self.memory_switches:
            arguments.update(tiled_mlp="auto", tiled_loss="auto", offload_checkpoints=True)
        if self.offload_optimizer:
            arguments["offload_optimizer"] = True
        return arguments


def recommend(config: Any, seq_len: int, *, devices_per_node: int, nodes: int = 1, device: str = "h100",
              budget_bytes: Optional[int] = None, precision: str = "bf16-mixed", micro_batch: int = 1,
              optimizer: str = "adamw", efficiency: float = 0.5, stages: tuple[int, ...] = (2, 3),
              memory_switches: tuple[bool, ...] = (False, True),
              offload_optimizer: tuple[bool, ...] = (False, True)) -> list[Recommendation]:
    """For every sp among the divisors of the world that the heads allow and each ZeRO stage, the quickest way to
    fit ``budget_bytes`` (default: the device's memory less its fixed cost, :attr:`Device.tensor_bytes`): without the memory switches and on the device if the plan
    fits so, else with the switches or the optimizer offloaded, else both (they only add recompute and host work), the highest estimated throughput first (tokens per second of the whole world: a smaller sp
    leaves more data-parallel replicas and exchanges less); empty if none fits. One plan per setting (about a second each for an
    8B model). ``stages``, ``memory_switches``, ``offload_optimizer``: the choices to consider."""
    hardware = DEVICES[device]
    budget = budget_bytes if budget_bytes is not None else hardware.tensor_bytes
    world = devices_per_node * nodes
    found = []
    for sp in [n for n in range(1, world + 1) if world % n == 0]:
        try:
            _validate(config, seq_len, sp, world)
        except ValueError:
            continue  # the heads do not split over sp ranks
        for stage in stages:
            # the memory switches (recompute) and the optimizer's offload only slow a step down: for each sp and
            # stage the first choices that fit, in that order, dominate the rest
            fitting_level = None
            for switches, offload in sorted(itertools.product(memory_switches, offload_optimizer),
                                            key=lambda choice: choice[0] + choice[1]):
                if fitting_level is not None and switches + offload > fitting_level:
                    break
                plan = plan_memory(config, seq_len, sp_size=sp, world_size=world, stage=stage, precision=precision,
                                   micro_batch=micro_batch, optimizer=optimizer, offload_optimizer=offload,
                                   tiled_mlp="auto" if switches else 0, tiled_loss="auto" if switches else 0,
                                   offload_checkpoints=switches)
                if plan.peak > budget:
                    continue
                fitting_level = switches + offload
                cost = step_cost(config, seq_len, sp_size=sp, world_size=world, stage=stage, precision=precision,
                                 micro_batch=micro_batch, recompute=switches, parameters=plan.parameters)
                seconds = step_seconds(cost, hardware, sp_size=sp, devices_per_node=devices_per_node, nodes=nodes,
                                       efficiency=efficiency)
                if offload:  # the optimizer step on the host: about 1e9 parameters per second per rank (CPU Adam)
                    seconds += plan.parameters / world / 1e9
                throughput = world // sp * micro_batch * seq_len / seconds
                found.append(Recommendation(sp, stage, switches, offload, plan, seconds, throughput))
    return sorted(found, key=lambda r: (-r.tokens_per_second, r.plan.peak))

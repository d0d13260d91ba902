"""The MoE router's load-balancing loss under SP, computed from the whole global batch.

transformers computes it in ``load_balancing_loss_func`` (a function of each MoE family's modeling module) from the
router logits of the tokens the model saw: under SP, this rank's shard only. The Switch-Transformer loss is
``E · Σ_e f_e · P_e`` with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e`` the mean router
probability of ``e`` over the tokens (of every MoE layer). Both are means over tokens, so the exact value needs the
sums over every rank's tokens: one all-reduce of ``2E + 1`` numbers per call. Only ``P`` carries a gradient, and it is
linear in this rank's probability sums, so this rank back-propagates ``E · Σ_e f_e · (its probability sum_e) / N``
with the SP losses' gradient scale: exact gradients, the same value on every rank.

:func:`exact_load_balancing_loss` patches the function of every prepared model's modeling module while the
strategy holds the model (a context manager; restored after fit).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.patches import replaced
from lightning_ulysses.training.loss import ValueWithGradientOf
from lightning_ulysses.training.step_context import StepContext

_FUNCTION = "load_balancing_loss_func"


def has_load_balancing_loss(model: nn.Module) -> bool:
    """Whether ``model``'s modeling module computes the router loss with transformers' ``load_balancing_loss_func``."""
    return callable(getattr(sys.modules.get(type(model).__module__), _FUNCTION, None))


@contextmanager
def exact_load_balancing_loss(models: list[nn.Module], context: StepContext) -> Iterator[None]:
    """Inside the block, the router loss of every model in ``models`` is the global batch's (see the module
    docstring); outside any step (generation, plain mode) the original function runs."""
    with ExitStack() as stack:
        for model in models:
            _replace_router_loss(model, context, stack)
        yield


def _replace_router_loss(model: nn.Module, context: StepContext, stack: ExitStack) -> None:
    """The router loss function of ``model``'s modeling module, replaced inside ``stack``."""
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, _FUNCTION, None)
    if original is None or getattr(original, "_ulysses", False):
        return

    def sp_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None, _original=original):
        if context.plain or not context.in_step or context.shard_info is None:
            return _original(gate_logits, num_experts, top_k, attention_mask)
        return sequence_parallel_load_balancing_loss(gate_logits, num_experts, top_k, context)

    sp_loss._ulysses = True  # type: ignore[attr-defined]
    stack.enter_context(replaced(module, _FUNCTION, sp_loss, f"{module.__name__}.{_FUNCTION}"))


def sequence_parallel_load_balancing_loss(gate_logits: Any, num_experts: Optional[int], top_k: int,
                                          context: StepContext) -> Any:
    """transformers' load-balancing loss over the whole global batch from this rank's router logits
    (``[B·s, E]`` per MoE layer); padding (the batch's right padding when the model was given the batch's mask, and the
    strategy's padding to a multiple of sp) does not count."""
    if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
        return 0
    device = gate_logits[0].device
    tokens = context.router_token_mask  # [B, s] bool: the tokens that count
    mask = tokens.reshape(-1).to(device=device, dtype=torch.float32)  # [B·s]
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer_gate in gate_logits:  # [B·s, E]
        routing = torch.softmax(layer_gate.to(device).float(), dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)  # [B·s, k]
        assignments = assignments.scatter_add(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        probabilities = probabilities + (routing * mask[:, None]).sum(dim=0)
        rows = rows + mask.sum()
    totals = torch.cat([assignments, probabilities.detach(), rows[None]]).double()  # [2E + 1]
    if group_size() > 1:
        dist.all_reduce(totals)  # [2E + 1] over every rank (DP × SP): the router loss of the global batch
    n = totals[-1].clamp(min=1.0)
    share_of_assignments = (totals[:num_experts] / n).float()  # f_e, global
    mean_probability = (totals[num_experts:2 * num_experts] / n).float()  # P_e, global
    value = num_experts * (share_of_assignments * mean_probability).sum()
    local = num_experts * (share_of_assignments * probabilities / n.float()).sum()  # this rank's part of P's sum
    return ValueWithGradientOf.apply(value, local * context.gradients.sp_loss_share, context.incoming_gradients)

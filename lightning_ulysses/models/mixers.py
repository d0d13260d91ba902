"""Sequence mixers other than attention (gated delta nets, Mamba/SSM mixers, short convolutions, lightning attention)
under SP: exact by running each mixer on the whole sequence, split by heads over the SP group.

A mixer's recurrence or convolution needs every earlier token of the sequence, which a shard does not have. The
exchange here gives it the whole sequence: before the mixer, one all-gather over the SP group turns this rank's
``[B, s, H]`` input into the full ``[B, S, H]``. Then the mixer's **own** forward (its projections, its convolution
and scan kernels: transformers' torch fallbacks on CPU, ``fla`` / ``mamba_ssm`` / ``causal_conv1d`` on CUDA when
installed) runs on it, narrowed to this rank's heads or channels by the recipe of its family
(:mod:`lightning_ulysses.models.mixer_families`, :mod:`lightning_ulysses.models.mixer_heads`), and the partial outputs
are summed and scattered back to shards (one reduce-scatter; backward: an all-gather, then the reduce-scatter of the
input gradients). A mixer no family claims runs whole on every rank and keeps its ``[B, s, H]`` slice of the output:
exact too, but its activations and compute are not divided by ``sp``.

Packed documents (``position_ids`` restarting at 0): the mixer runs once per document, so no recurrence or
convolution crosses a document start, as separate rows on one device would.

Mixers are found by what a module *is*: it owns an ``A_log`` parameter (state-space decay: Mamba, gated delta
nets), has a depthwise ``nn.Conv1d`` child over the sequence (kernel > 1: Mamba's and the delta nets' causal
convolutions, short convolutions), or holds lightning attention's ``slope_rate`` buffer; and it contains no attention
module of its own.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses.models.mixer_heads import head_slicing, narrowed
from lightning_ulysses.parallel.exchange import gather_sequence_differentiable, reduce_scatter_sequence
from lightning_ulysses.training.step_context import StepContext

_ORIGINAL = "_ulysses_mixer_forward"
_HIDDEN_NAMES = ("hidden_states", "input_states", "x")
_MASK_NAMES = ("attention_mask", "mask")


def is_sequence_mixer(module: nn.Module) -> bool:
    """Whether ``module`` mixes the sequence by a recurrence or a convolution (see the module docstring)."""
    own_parameters = dict(module.named_parameters(recurse=False))
    own_buffers = dict(module.named_buffers(recurse=False))
    if "A_log" in own_parameters or "slope_rate" in own_buffers:
        return True
    return any(isinstance(child, nn.Conv1d) and child.kernel_size[0] > 1 and child.groups == child.in_channels
               for child in module.children())


def find_sequence_mixers(model: nn.Module, is_attention: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The outermost sequence mixers of ``model`` that hold no attention module (``is_attention``)."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered or not is_sequence_mixer(module):
            continue
        if any(is_attention(m) for m in module.modules()):
            continue
        found.append(module)
        covered.update(id(m) for m in module.modules())
    return found


def uncovered_sequence_convolutions(model: nn.Module, mixers: list[nn.Module]) -> list[str]:
    """Names of convolutions over the sequence that no wrapped mixer contains (they would see only the shard)."""
    covered = {id(m) for mixer in mixers for m in mixer.modules()}
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1 and id(module) not in covered]


def wrap_sequence_mixer(module: nn.Module, context: StepContext) -> None:
    """Make ``module`` run on the whole sequence under SP (see the module docstring). Idempotent; undone by
    :func:`unwrap_sequence_mixer`."""
    if _ORIGINAL in module.__dict__:
        return
    original = type(module).forward
    module.__dict__[_ORIGINAL] = original
    if context.zero_stage_3:  # gather the submodules' weights for this module's whole forward and backward
        _register_external_parameters(module)
    recipes: dict[tuple[int, int], Any] = {}  # (rank, sp) -> this mixer's head slicing (or None), built once

    def forward(*args: Any, **kwargs: Any) -> Any:
        group = context.ulysses_group
        if context.plain or context.shard_info is None or dist.get_world_size(group) == 1:
            return original(module, *args, **kwargs)
        args, kwargs, hidden = _take_hidden(args, kwargs)
        for name in _MASK_NAMES:  # a padding mask of the shard: right padding needs none (the mixers are causal)
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = None
        full = gather_sequence_differentiable(hidden, group)  # [B, s, H] -> [B, S, H] (backward: reduce-scatter)
        shard = context.shard_info
        rank, sp, s = dist.get_rank(group), dist.get_world_size(group), hidden.shape[1]
        if (rank, sp) not in recipes:
            recipes[(rank, sp)] = head_slicing(module, rank, sp, group, hidden.device)
        slicing = recipes[(rank, sp)]

        def run(x: torch.Tensor) -> Any:
            return original(module, x, *args, **kwargs)

        if slicing is not None:  # this rank's heads over the whole sequence; partial outputs summed over the group
            with narrowed(module, slicing, rank):
                partial = _per_document(run, full, shard.cu_seqlens) if shard.packed else run(full)  # [B, S, H]
            if isinstance(partial, tuple):
                return (reduce_scatter_sequence(partial[0], group), *partial[1:])
            return reduce_scatter_sequence(partial, group)  # [B, S, H] partial sums -> [B, s, H] (backward: all-gather)
        output = _per_document(run, full, shard.cu_seqlens) if shard.packed else run(full)
        return _own_slice(output, full.shape[:2], slice(rank * s, (rank + 1) * s))

    module.__dict__["forward"] = forward


def unwrap_sequence_mixer(module: nn.Module) -> None:
    if module.__dict__.pop(_ORIGINAL, None) is not None:
        module.__dict__.pop("forward", None)
        for parameter in module.__dict__.pop(_EXTERNAL, []):
            from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

            unregister_external_parameter(module, parameter)


_EXTERNAL = "_ulysses_external_parameters"


def _register_external_parameters(module: nn.Module) -> None:
    """Under ZeRO-3 DeepSpeed gathers a submodule's weights only while that submodule runs; registered as external
    parameters of the mixer they are gathered for the mixer's whole forward and backward, so the head-parallel
    recipes can slice them there (DeepSpeed's documented way for weights used outside their module)."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    own = {id(p) for p in module.parameters(recurse=False)}
    registered = [p for p in module.parameters() if id(p) not in own]
    for parameter in registered:
        register_external_parameter(module, parameter)
    module.__dict__[_EXTERNAL] = registered


def _take_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    if args and isinstance(args[0], torch.Tensor):
        return args[1:], dict(kwargs), args[0]
    kwargs = dict(kwargs)
    for name in _HIDDEN_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return args, kwargs, kwargs.pop(name)
    raise TypeError("A sequence mixer was called without its hidden states as the first argument.")


def _per_document(run: Callable[[torch.Tensor], Any], full: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Any:
    """``run`` on every packed document of ``full`` ``[B, S, H]`` separately (offsets in the flattened ``[B·S]``);
    the outputs (tensor, or tuple whose first item is the tensor) put back together as ``[B, S, ...]``."""
    B, S = full.shape[:2]
    flat = full.reshape(1, B * S, *full.shape[2:])  # [1, B·S, H]
    bounds = cu_seqlens.tolist()  # type: ignore[union-attr]
    outputs = [run(flat[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    first = [o[0] if isinstance(o, tuple) else o for o in outputs]
    joined = torch.cat(first, dim=1).reshape(B, S, *first[0].shape[2:])  # [B, S, ...]
    return (joined, *outputs[-1][1:]) if isinstance(outputs[-1], tuple) else joined


def _own_slice(output: Any, full_shape: torch.Size, own: slice) -> Any:
    """This rank's positions of the mixer's output (a tensor, or a tuple whose first item is)."""
    if isinstance(output, torch.Tensor) and tuple(output.shape[:2]) == tuple(full_shape):
        return output[:, own]
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (_own_slice(output[0], full_shape, own), *output[1:])
    raise TypeError(f"A sequence mixer returned {type(output).__name__}, not its [B, S, ...] output.")

"""ALST memory features for Hugging Face causal LMs, switched on per model and removed after the Trainer finishes.

* **Tiled MLP**: each decoder layer's MLP runs on ``tiles`` slices of the sequence and is recomputed slice by slice in
  backward, so the ``[s, intermediate]`` activations never exist for the whole shard. The layer's norms run the same
  way (their eager backward in 16 bits holds several float32 ``[s, H]`` temporaries at once: in a checkpointed layer
  the step's largest moment; tiled, one tile's worth). Same algorithm as DeepSpeed's
  ``TiledMLP``, but with exactly ``tiles`` slices for every shard length (``torch.tensor_split``, empty slices
  allowed): DeepSpeed's ``torch.chunk`` returns fewer chunks for some lengths (10 tokens in 6 tiles: 5 chunks),
  and then never marks the weight gradients ready for ZeRO's reduction, and ranks with different lengths issue
  different numbers of ZeRO-3 parameter gathers.
* **Tiled logits + loss**: the LM head and the cross-entropy run on ``chunks`` slices of the sequence under
  activation checkpointing, so the ``[s, vocab]`` logits exist for one slice at a time, in forward and backward.
  The normalisation happens on the summed loss *outside* the chunks, through autograd (DeepSpeed's
  ``TiledFusedLogitsLoss`` computes weight gradients inside its forward, where a later scale is lost).
* **Checkpoint offload**: decoder layers run under activation checkpointing (``use_reentrant=False``) and the tensors
  autograd keeps (the layer inputs) move to host memory until backward (tensors already on the host stay put). With
  ``ulysses_offload`` (the strategy's ``offload_attention``) the layers run again in backward through
  :mod:`lightning_ulysses.offload.layer_checkpoint`, whose recompute keeps its saved tensors in host memory as well.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ulysses import _compat
from lightning_ulysses.offload import layer_checkpoint
from lightning_ulysses.models.rng_replay import replayed_rng, rng_states
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training import loss_graph
from lightning_ulysses.training.loss import cross_entropy_sum, step_loss_from_sum, token_statistics
from lightning_ulysses.training.step_context import StepContext

AUTO = "auto"
TileSetting = Union[int, Literal["auto"]]
# "auto" tile sizes. MLP: ALST's rule, one tile per `hidden_size` tokens (a tile's intermediate activations are then
# about `intermediate/hidden` × the layer's weight-sized matrices). Loss: at most 2**24 logits per chunk (64 MiB in
# fp32, e.g. 524 tokens at a 32K vocabulary), so the loss's memory no longer grows with the sequence.
LOSS_CHUNK_LOGITS = 2**24


@dataclass(frozen=True)
class MemoryFeatures:
    """Which features to switch on (all off by default).

    ``tiled_mlp`` / ``tiled_loss``: a fixed number of sequence tiles (``0``: off), or ``"auto"``: as many as the step's
    shard length needs for a bounded tile (the memory of that feature then stops growing with the sequence length).
    """

    tiled_mlp: TileSetting = 0  # sequence tiles per MLP call
    tiled_loss: TileSetting = 0  # sequence chunks for LM head + loss
    offload_checkpoints: bool = False  # checkpoint decoder layers, keep the checkpoints in CPU memory
    # the strategy's offload_attention is on: the rotary embedding runs in tiles of positions, and with
    # offload_checkpoints the layers' recompute keeps its saved tensors in host memory too
    ulysses_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("tiled_mlp", "tiled_loss"):
            value = getattr(self, name)
            if value == AUTO:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}={value!r}`: pass a number of tiles (0 = off) or \"auto\".")
        if not isinstance(self.offload_checkpoints, bool):
            raise ValueError(f"`offload_checkpoints={self.offload_checkpoints!r}`: pass True or False.")

    @property
    def any(self) -> bool:
        return bool(self.tiled_mlp or self.tiled_loss or self.offload_checkpoints or self.ulysses_offload)

    @property
    def alst(self) -> bool:
        """Whether one of ALST's switches is on (tiled MLP, tiled loss, offloaded checkpoints)."""
        return bool(self.tiled_mlp or self.tiled_loss or self.offload_checkpoints)

    @property
    def auto(self) -> bool:
        """Whether a tile count depends on the step's shard length."""
        return AUTO in (self.tiled_mlp, self.tiled_loss)


def tile_count(setting: TileSetting, shard_len: int, tile_tokens: int) -> int:
    """Tiles for a shard of ``shard_len`` tokens: ``setting`` itself, or for ``"auto"`` one per ``tile_tokens``."""
    if setting == AUTO:
        return max(1, math.ceil(shard_len / max(1, tile_tokens)))
    return int(setting)


def _tiles_run(tiles: int) -> list[int]:
    """The tiles (or loss chunks) a pass runs: all of them. The planner's meta-device trace runs a sample instead
    (:mod:`lightning_ulysses.plan.activations`): every tile allocates and frees the same, so three show the peak."""
    return list(range(tiles))


def _agreed_shard_len(local_len: int, context: Optional[StepContext]) -> int:
    """The shard length tile counts are computed from: the step's maximum over all ranks where the strategy needs
    every rank to issue the same ZeRO-3 gathers (see ``StepContext.tile_shard_len``), else the local one."""
    if context is not None and context.tile_shard_len is not None:
        return context.tile_shard_len
    return local_len


_MEMORY_STATE = "_ulysses_memory_saved"


def _decoder_mlps(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith(".mlp") and hasattr(m, "forward")]


def _decoder_norms(model: nn.Module) -> list[nn.Module]:
    """The norms of the hidden states, recognised by shape: the direct children of each decoder layer (the parent
    of an ``.mlp``) and of the model that holds the layers (its final norm) that have no children, whose parameters
    are all ``[hidden_size]`` (a scale, a bias) and whose forward takes one input (``[B, s, H]``, each token on its
    own; gated norms of two inputs are left alone). Their eager backward in 16 bits holds several float32 ``[s, H]``
    temporaries at once (the upcast input, the normalised values, their products with the gradient): with the layers
    checkpointed, the step's largest moment (the final norm's backward, then each layer's), which a tiled norm holds
    for one tile. Norms without parameters (OLMo's) are not recognised and run whole."""
    config = model.config
    hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None), "hidden_size", None)
    layers = {name.rpartition(".")[0] for name, _ in model.named_modules() if name.endswith(".mlp")}
    owners = layers | {layer.rpartition(".")[0].rpartition(".")[0] for layer in layers}  # "model.layers.3" -> "model"
    found = []
    for name, module in model.named_modules():
        if not name or name.rpartition(".")[0] not in owners or next(module.children(), None) is not None:
            continue
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters()]  # ZeRO 3: the whole shape
        if hidden and shapes and all(shape == (hidden,) for shape in shapes) and _one_input(type(module).forward):
            found.append(module)
    return found


def _attention_norms(model: nn.Module) -> list[nn.Module]:
    """The query and key norms inside each layer's attention (Qwen3's, Gemma 3's and OLMo 2's ``q_norm``/``k_norm``),
    recognised by shape: leaf children of a decoder layer's direct children (not of its ``.mlp``), whose parameters
    are all one-dimensional of the head size, the query projection's or the key projection's width, and whose forward
    takes one input (``[B, s, heads, head_dim]`` or ``[B, s, heads·head_dim]``, each row on its own). Their eager
    backward in 16 bits holds several float32 copies of the whole projection (Qwen3-8B's shape, ALST's switches:
    10 of its 14 ``[s, H]`` peak); tiled over the rows, one tile's worth. A norm whose output on rows differs from its
    output on the whole input (checked once per input layout) runs whole."""
    config = getattr(model.config, "text_config", None) or model.config
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not hidden or not heads:
        return []
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = {head_dim, heads * head_dim, kv_heads * head_dim}
    layers = {name.rpartition(".")[0] for name, _ in model.named_modules() if name.endswith(".mlp")}
    found = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if parent.rpartition(".")[0] not in layers or parent.endswith(".mlp") or \
                next(module.children(), None) is not None:
            continue
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters()]  # ZeRO 3: the whole shape
        if shapes and all(len(shape) == 1 and shape[0] in sizes for shape in shapes) and \
                _one_input(type(module).forward):
            found.append(module)
    return found


def _one_input(forward: Any) -> bool:
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in parameters)


def enable(model: nn.Module, features: MemoryFeatures, context: Optional[StepContext]) -> None:
    """Switch ``features`` on for the Hugging Face causal LM ``model`` (undo with :func:`disable`)."""
    if not features.any or held_on_instance(model, _MEMORY_STATE):
        return
    saved: dict[str, Any] = {"mlps": [], "forward": None, "checkpointing": False, "owned_attention": []}
    if features.ulysses_offload:  # the registered families' attention blocks run by the strategy itself
        from lightning_ulysses.offload import attention_block

        saved["owned_attention"] = attention_block.install(model)
    if features.tiled_mlp:  # each decoder layer's per-token modules: its MLP and its norms
        hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)
        for module in _decoder_mlps(model) + _decoder_norms(model):
            _tile_mlp(module, features.tiled_mlp, hidden_size, context)
            saved["mlps"].append(module)
        for module in _attention_norms(model):  # over the rows of the projection they normalise
            _tile_mlp(module, features.tiled_mlp, hidden_size, context, rows=True)
            saved["mlps"].append(module)
    if features.tiled_loss or features.offload_checkpoints:
        saved["forward"] = on_instance(model, "forward")
        model.forward = _memory_forward(model, features, context)  # type: ignore[method-assign]
    if features.offload_checkpoints:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        saved["checkpointing"] = True
    if features.ulysses_offload:  # the layers checkpointed here or by the model's own gradient checkpointing
        saved["checkpoint_functions"] = layer_checkpoint.use_for_layers(model, features.offload_checkpoints)
    put_on_instance(model, _MEMORY_STATE, saved)


def disable(model: nn.Module) -> None:
    saved = take_from_instance(model, _MEMORY_STATE, None)
    if saved is None:
        return
    for mlp in saved["mlps"]:
        take_from_instance(mlp, "forward", None)
    if saved.get("owned_attention"):
        from lightning_ulysses.offload import attention_block

        attention_block.uninstall(saved["owned_attention"])
    if held_on_instance(model, "forward"):
        del model.forward
    if saved["forward"] is not None:
        model.forward = saved["forward"]
    for module, function in saved.get("checkpoint_functions", ()):
        module._gradient_checkpointing_func = function
    if saved["checkpointing"]:
        model.gradient_checkpointing_disable()


def _tile_mlp(mlp: nn.Module, setting: TileSetting, hidden_size: int, context: Optional[StepContext],
              rows: bool = False) -> None:
    """Run ``mlp`` through :class:`TiledMLP` over dim -2 of its input ``[B, s, H]``; ``rows``: over every row of
    its last dimension (``[..., D]`` seen as ``[N, D]``: a norm of each head's vector), as many tiles as a ``[B, s,
    H]`` input of the same bytes would have, where the module gives the same output on rows (else it runs whole)."""
    original = type(mlp).forward.__get__(mlp)
    params = [p for p in mlp.parameters() if p.requires_grad]

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:  # x: [B, s, H] (rows: [..., D])
        if rows and not _rows_independent(original, x):
            return original(x)
        tokens = x.numel() // max(1, hidden_size) if rows else x.shape[-2]
        tiles = tile_count(setting, _agreed_shard_len(tokens, context), hidden_size or x.shape[-1])
        shape = x.shape
        if rows:
            x = x.reshape(-1, shape[-1])  # [N, D]
        if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in params):
            # an input without a gradient (the first norm after frozen embeddings): the weights are not inputs of
            # the node, so it joins the graph only through an input that asks for one
            x = x.detach().requires_grad_()
        out = TiledMLP.apply(original, x, tiles, params)
        return out.view(*shape[:-1], out.shape[-1]) if rows else out

    mlp.forward = tiled_forward  # type: ignore[method-assign]


# module -> {(dtype, dims, last dim, device type): whether it gives the same bits on rows}
_ROWS_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]]" = weakref.WeakKeyDictionary()


def _rows_independent(original: Any, x: torch.Tensor) -> bool:
    """Whether ``original`` (a module's bound forward) gives, on the rows of a few positions of ``x`` seen as ``[N,
    D]``, bit for bit what it gives on them in ``x``'s layout; once per module, dtype and layout."""
    verdicts = _ROWS_VERDICTS.setdefault(original.__self__, {})
    key = (x.dtype, x.dim(), x.shape[-1], x.device.type)
    verdict = verdicts.get(key)
    if verdict is None:
        if x.device.type == "meta" or x.dim() < 2:
            return x.device.type == "meta"  # (the planner's trace: shapes only, as the strategy's run decides)
        with torch.no_grad():
            sample = x.detach().narrow(1, 0, min(3, x.shape[1])).contiguous()  # [B, ≤3, ...]
            whole = original(sample)
            by_rows = original(sample.reshape(-1, sample.shape[-1]))
        verdict = by_rows.shape[0] == whole.numel() // whole.shape[-1] and \
            torch.equal(by_rows.reshape(whole.shape), whole)
        verdicts[key] = verdict
    return verdict


class TiledMLP(torch.autograd.Function):
    """``mlp(x)`` computed on exactly ``tiles`` slices of the sequence dimension (-2), keeping only ``x`` for
    backward, where each slice is recomputed and back-propagated on its own. ``mlp``: any module that treats each
    token on its own (a decoder layer's MLP, the hidden states' norms: :func:`_decoder_norms`).

    Exactly ``tiles`` slices for every length (``torch.tensor_split``; slices may be empty): every rank runs the MLP
    the same number of times (ZeRO-3 gathers its weights per call), and the last slice is known, so the weights'
    gradients are marked ready for ZeRO's reduction (``ds_grad_is_ready``) only once all slices have added theirs.
    """

    @staticmethod
    def forward(ctx, mlp, x: torch.Tensor, tiles: int, params: list[torch.Tensor]) -> torch.Tensor:
        # ``params`` is a list, not tensor arguments: as inputs of this node their AccumulateGrad nodes would run
        # again (with no gradient) after this backward, and ZeRO's hooks on them would reduce a second time.
        ctx.mlp, ctx.tiles, ctx.params = mlp, tiles, params
        ctx.rng = rng_states(x.device)  # backward replays the tiles with the random numbers they drew here (dropout)
        ctx.save_for_backward(x)
        out: Optional[torch.Tensor] = None
        x_tiles = torch.tensor_split(x, tiles, dim=-2)  # [B, s/tiles, H] each
        starts = [0]
        for x_tile in x_tiles:
            starts.append(starts[-1] + x_tile.shape[-2])
        with torch.no_grad():
            for index in _tiles_run(tiles):
                out_tile = mlp(x_tiles[index].contiguous())  # B > 1: a slice of dim -2 is not (Conv1D views it)
                if out is None:  # one output written tile by tile (a list and a cat held it twice)
                    out = out_tile.new_empty((*x.shape[:-1], out_tile.shape[-1]))  # [B, s, H]
                out.narrow(-2, starts[index], x_tiles[index].shape[-2]).copy_(out_tile)
                del out_tile
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[1] else None  # [B, s, H]
        x_tiles = torch.tensor_split(x.detach(), ctx.tiles, dim=-2)
        grad_tiles = torch.tensor_split(grad_output, ctx.tiles, dim=-2)
        starts = [0]
        for x_tile in x_tiles:
            starts.append(starts[-1] + x_tile.shape[-2])
        with replayed_rng(x.device, ctx.rng):
            _tiles_backward(ctx, x_tiles, grad_tiles, starts, grad_x)
        if grad_x is not None:
            layer_checkpoint.hand_on(grad_x)  # the final norm's: the last checkpointed layer may park it
        return None, grad_x, None, None


def _tiles_backward(ctx: Any, x_tiles: tuple, grad_tiles: tuple, starts: list[int],
                    grad_x: Optional[torch.Tensor]) -> None:
    """:class:`TiledMLP`'s backward, tile by tile in the forward's order: each tile recomputed and back-propagated
    on its own, its input gradient written into ``grad_x [B, s, H]``, the weights' gradients added in place."""
    for index in _tiles_run(ctx.tiles):
        x_tile, grad_tile, start = x_tiles[index], grad_tiles[index], starts[index]
        last = index == ctx.tiles - 1
        for param in ctx.params:  # ZeRO reduces a weight's gradient once every slice has added to it
            _compat.defer_zero3_gradient(param, ready=last)
        x_tile = x_tile.contiguous().requires_grad_(grad_x is not None)  # B > 1: as in forward
        with torch.enable_grad():
            out_tile = ctx.mlp(x_tile)
        torch.autograd.backward(out_tile, grad_tile)  # adds to the weights' .grad (and to x_tile.grad)
        if grad_x is not None:
            length = x_tile.shape[-2]
            grad_x.narrow(-2, start, length).copy_(x_tile.grad)
            x_tile.grad = None  # (the tuple of tiles keeps x_tile: its gradient would stay to the end)


loss_graph.register_sharded_computation(TiledMLP)  # a tile of the MLP on this rank's shard


def _memory_forward(model: nn.Module, features: MemoryFeatures, context: Optional[StepContext]):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward.__get__(model)

    def forward(*args: Any, labels: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                **kwargs: Any):
        offload = features.offload_checkpoints and torch.is_grad_enabled()
        saving = _offload_to_host() if offload else contextlib.nullcontext()
        with saving:
            if not features.tiled_loss or (labels is None and shift_labels is None):
                return original(*args, labels=labels, shift_labels=shift_labels, **kwargs)
            hidden = model.base_model(*args, **kwargs).last_hidden_state  # [B, s, H]
            if shift_labels is None:
                raise ValueError("Tiled loss needs `shift_labels` (the strategy's collate step adds them).")
            lm_head = model.get_output_embeddings()
            chunk_tokens = LOSS_CHUNK_LOGITS // max(1, int(lm_head.weight.shape[0]))
            chunks = tile_count(features.tiled_loss, _agreed_shard_len(hidden.shape[1], context), chunk_tokens)
            if torch.is_grad_enabled() or context is None:
                local_sum = tiled_cross_entropy_sum(hidden, lm_head, shift_labels, chunks)
            else:  # evaluation: per-token losses chunk by chunk (no backward, so no checkpointing)
                context.record.record_token_stats(tiled_token_statistics(hidden, lm_head, shift_labels, chunks))
                local_sum = context.token_stats[0].sum()
            return CausalLMOutputWithPast(loss=step_loss_from_sum(context, local_sum, shift_labels), logits=None)

    return forward


def _offload_to_host() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved tensors on an accelerator move to (pinned) host memory until backward; host tensors stay as they are
    (``torch.autograd.graph.save_on_cpu`` would copy them, doubling what it should save)."""

    def pack(tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def tiled_cross_entropy_sum(hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor,
                            chunks: int) -> torch.Tensor:
    """``sum(CE(lm_head(hidden), shift_labels))`` over valid tokens with only one chunk's logits alive at a time.

    ``hidden [B, s, H]``, ``shift_labels [B, s]``; each chunk's logits are recomputed in backward. Exactly ``chunks``
    calls of ``lm_head`` for every length (empty chunks allowed), so ZeRO-3 gathers its weight equally on every rank.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    pieces = list(zip(torch.tensor_split(hidden, chunks, dim=1), torch.tensor_split(shift_labels, chunks, dim=1)))
    for index in _tiles_run(chunks):
        h, y = pieces[index]
        total = total + checkpoint(_chunk_loss_sum, h, y, lm_head, use_reentrant=False)
    return total


def tiled_token_statistics(hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor,
                           chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~lightning_ulysses.training.loss.token_statistics` with one chunk's logits alive at a time (no
    gradients)."""
    parts = [token_statistics(lm_head(h), y) for h, y in zip(torch.tensor_split(hidden, chunks, dim=1),
                                                              torch.tensor_split(shift_labels, chunks, dim=1))]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)  # [B, s] each


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    return cross_entropy_sum(lm_head(hidden), labels)  # [B, c, V] logits: one chunk only

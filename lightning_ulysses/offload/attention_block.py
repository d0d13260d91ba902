"""The attention block the strategy runs itself under ``offload_attention`` (Ulysses-Offload), for the families
registered in :mod:`lightning_ulysses.families.attention_blocks`.

A Hugging Face attention module keeps its projections' outputs, its rotated q and k and its value as local variables
until it returns: through the output projection, the layer's largest moment once the chunked attention holds nothing
of the whole shard, they are 1.5 ``[s, H]`` of bytes nobody reads again (Llama-3.1-8B). The strategy cannot free
what the model's code holds; it can own the code. :func:`install` gives each attention module whose forward a recipe
describes an instance ``forward`` that computes the same (the module's own projections, norms and output projection
called as modules, so their hooks fire; the modeling module's own ``apply_rotary_pos_emb``, in tiles of positions;
the configured attention function) and drops each of its own temporaries as soon as the next step has read it: the
rotation before the value projection runs, q, k and v before the output projection. A tensor that anything else
still references (a user's hook that keeps a projection's output) stays as it is: nothing is released or rewritten
behind a reference, only this block's own references are dropped.

Only an exact match is owned: the class that defines the module's ``forward`` is the registered class of its
modeling module and its source has the recipe's digest (no subclass that overrides ``forward``, no replaced instance
``forward``, no other transformers version); a call with a cache (generation) runs the module's own forward.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.families.attention_blocks import AttentionBlockRecipe, recipe_for
from lightning_ulysses.offload import rotary_tiles
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance

_OWNED = "_ulysses_owned_attention"  # marks the instance forward this module installed
OWNED_CALLS = [0]  # calls that ran the owned block (a count for tests)
_digests: dict[Any, Optional[str]] = {}
_warned: set[type] = set()  # classes whose forward differs from their recipe's source: told once


def _defining_class(module: nn.Module) -> Optional[type]:
    return next((cls for cls in type(module).__mro__ if "forward" in vars(cls)), None)


def _digest(forward: Callable) -> Optional[str]:
    if forward not in _digests:
        try:
            _digests[forward] = hashlib.sha256(inspect.getsource(forward).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            _digests[forward] = None
    return _digests[forward]


def recipe_of(module: nn.Module) -> Optional[AttentionBlockRecipe]:
    """The recipe the strategy runs ``module``'s attention block by, ``None`` where it runs the module's own forward
    (no registered class, a forward overridden or replaced, source other than the recipe was written from)."""
    if held_on_instance(module, "forward"):
        return None
    cls = _defining_class(module)
    recipe = None if cls is None else recipe_for(cls.__module__, cls.__name__)
    if recipe is None or getattr(sys.modules.get(recipe.modeling_module), recipe.attention_class, None) is not cls:
        return None
    if _digest(vars(cls)["forward"]) != recipe.forward_digest:
        if cls not in _warned:
            _warned.add(cls)
            warnings.warn(f"{cls.__name__}.forward differs from the source the strategy's attention block for it was"
                          " written from (another transformers version than the tested one, requirements/lock.txt):"
                          " offload_attention runs the module's own forward, exact but holding its q, k and v to the"
                          " end of the call (more memory than planned for the tested version).", stacklevel=2)
        return None
    return recipe


def install(model: nn.Module) -> list[nn.Module]:
    """Run the attention blocks of ``model`` that a recipe describes with :func:`_owned_forward`; the modules, for
    :func:`uninstall`."""
    owned = []
    for module in model.modules():
        recipe = recipe_of(module)
        if recipe is None:
            continue
        original = module.forward  # the class's, bound

        def forward(*args: Any, _module: nn.Module = module, _recipe: AttentionBlockRecipe = recipe,
                    _original: Callable = original, **kwargs: Any) -> Any:
            return _owned_forward(_module, _recipe, _original, *args, **kwargs)

        setattr(forward, _OWNED, True)
        put_on_instance(module, "forward", forward)
        owned.append(module)
    return owned


def uninstall(modules: list[nn.Module]) -> None:
    for module in modules:
        if getattr(on_instance(module, "forward"), _OWNED, False):
            take_from_instance(module, "forward")


def _window(module: nn.Module, recipe: AttentionBlockRecipe) -> dict[str, Any]:
    if recipe.window_from == "module":
        return {"sliding_window": module.sliding_window}
    if recipe.window_from == "config":
        return {"sliding_window": getattr(module.config, "sliding_window", None)}
    return {}


def _heads(projection: torch.Tensor, norm: Optional[nn.Module], shape: tuple) -> torch.Tensor:
    """``[B, s, h·D]`` -> ``[B, h, s, D]``, each head's vector normalised first where the family has a norm."""
    heads = projection.view(shape)  # [B, s, h, D]
    if norm is not None:
        heads = norm(heads)
    return heads.transpose(1, 2)


def _owned_forward(module: nn.Module, recipe: AttentionBlockRecipe, original: Callable, hidden_states: torch.Tensor,
                   position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   attention_mask: Optional[torch.Tensor] = None, cache: Any = None, **kwargs: Any) -> Any:
    cache = cache if cache is not None else kwargs.get("past_key_values")
    if cache is not None or position_embeddings is None:  # generation, or a call the recipe was not written for
        return original(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    kwargs.pop("past_key_values", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    OWNED_CALLS[0] += 1
    modeling = sys.modules[recipe.modeling_module]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = _heads(module.q_proj(hidden_states), module.q_norm if recipe.head_norms else None, hidden_shape)
    key = _heads(module.k_proj(hidden_states), module.k_norm if recipe.head_norms else None, hidden_shape)
    cos, sin = position_embeddings
    # [B, Hq, s, D], [B, Hkv, s, D]: rotated in tiles into new tensors; the unrotated ones are dropped here
    query, key = rotary_tiles.tiled(modeling.apply_rotary_pos_emb)(query, key, cos, sin)
    value = _heads(module.v_proj(hidden_states), None, hidden_shape)  # [B, Hkv, s, D], after the rotation's peak
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(_compat.attention_implementation(module.config),
                                                      modeling.eager_attention_forward)
    out, weights = attention(module, query, key, value, attention_mask,
                             dropout=0.0 if not module.training else module.attention_dropout,
                             scaling=module.scaling, **_window(module, recipe), **kwargs)  # [B, s, Hq, D]
    del query, key, value  # the chunked attention keeps what its backward needs; nothing here reads them again
    out = out.reshape(*input_shape, -1).contiguous()  # [B, s, Hq·D]
    return module.o_proj(out), weights

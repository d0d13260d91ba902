"""Attention blocks the strategy runs itself under ``offload_attention`` (Ulysses-Offload): per family, what its
attention module's forward does, so that :mod:`lightning_ulysses.offload.attention_block` can run the same
computation as the strategy's own code (projections, q/k norms, the rotary embedding in tiles of positions, the
chunked exchange and attention, the output projection) and free its own temporaries as soon as the next step has
read them, as DeepSpeed's FPDT layer owns its block.

A recipe is written from one version of the class's ``forward`` and names it by a digest of its source: a class whose
forward's source differs (another transformers), a subclass that overrides ``forward``, or an instance whose
``forward`` was replaced runs its own forward as it is (the generic path), never a recipe written for other code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttentionBlockRecipe:
    """What one family's attention forward computes, in the terms the owned block runs.

    Attributes:
        modeling_module: the transformers module that defines the class and its ``apply_rotary_pos_emb``.
        attention_class: the attention module's class name in it.
        forward_digest: sha256 (first 16 hex digits) of ``inspect.getsource(attention_class.forward)`` the recipe was
            written from and tested against.
        head_norms: ``q_norm``/``k_norm`` run on each head's vector after the projection (``[B, s, h, D]``), before
            the transpose (Qwen3).
        window_from: where the layer's sliding window comes from: ``None`` (no window keyword), ``"module"``
            (``module.sliding_window``) or ``"config"`` (``module.config.sliding_window``).
    """

    modeling_module: str
    attention_class: str
    forward_digest: str
    head_norms: bool = False
    window_from: Optional[str] = None


# transformers 5.24's forwards (requirements/lock.txt): each the same block, differing as the fields say.
OWNED_ATTENTION_BLOCKS: tuple[AttentionBlockRecipe, ...] = (
    AttentionBlockRecipe("transformers.models.llama.modeling_llama", "LlamaAttention", "e080b5cc468cd0a5"),
    AttentionBlockRecipe("transformers.models.mistral.modeling_mistral", "MistralAttention", "574be7fb3f193570",
                         window_from="config"),
    AttentionBlockRecipe("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", "958fda1e108c1fe8",
                         window_from="module"),
    AttentionBlockRecipe("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", "648a188563d3f5ea",
                         head_norms=True, window_from="module"),
)


def recipe_for(class_module: str, class_name: str) -> Optional[AttentionBlockRecipe]:
    """The recipe registered for the class ``class_name`` defined in ``class_module``, ``None`` if none."""
    return next((r for r in OWNED_ATTENTION_BLOCKS
                 if r.modeling_module == class_module and r.attention_class == class_name), None)

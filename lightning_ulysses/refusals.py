"""What a Hugging Face model must be to train under SP, checked before any compute: a supported attention
implementation, heads that split over the Ulysses ranks, and no way of mixing the sequence that the strategy cannot
make exact (unrecognised sequence mixers, attention outside transformers' interface, ALiBi, learned mask biases,
indexed attention, an auxiliary loss computed per shard). Every refusal is a ``ValueError`` that says why and what
to change.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator, Optional

from torch import nn

from lightning_ulysses.hf_attention import _PREFIX, SUPPORTED_ATTENTION, attention_implementation
from lightning_ulysses.mixers import find_sequence_mixers, uncovered_sequence_convolutions
from lightning_ulysses.moe import has_load_balancing_loss

def _configs(model: nn.Module) -> Iterator[Any]:
    config = model.config
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def validate_model(model: nn.Module, sp_size: int, device_type: str, ring_size: int = 1) -> None:
    """Raise a ``ValueError`` (before any compute) if ``model`` cannot run Ulysses attention at ``sp_size`` (the
    Ulysses part of it: ``sp_size / ring_size`` ranks share the heads)."""
    name = type(model).__name__
    impl = model.config._attn_implementation
    if impl is not None and impl.startswith(_PREFIX):
        impl = impl[len(_PREFIX) :]
    if not has_attention(model) and sequence_mixers(model):  # a pure state-space model: no attention to shard
        refuse_unsupported_architecture(model)
        if ring_size > 1:
            raise ValueError(f"{name} has no attention, only sequence mixers: use ring_size=1.")
        return
    if impl not in SUPPORTED_ATTENTION:
        usable = supported_implementations(model)
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}, which UlyssesDeepSpeedStrategy cannot shard. Under sequence"
            f" parallelism it runs {list(SUPPORTED_ATTENTION)} ('flash_attention_2/3' and 'flex_attention' on CUDA);"
            + (f" {name} supports {usable}: build it with one of them, e.g."
               f" `AutoModelForCausalLM.from_config(config, attn_implementation={usable[0]!r})`"
               f" or `model.set_attn_implementation({usable[0]!r})`."
               if usable else f" {name} supports none of them, so it cannot train under sequence parallelism.")
            + (" On CPU only 'sdpa' runs, which this model does not support." if "sdpa" not in usable else "")
        )
    refuse_unsupported_architecture(model)
    mixers = sequence_mixers(model)
    if ring_size > 1 and mixers:
        raise ValueError(
            f"{name} has sequence mixers other than attention ({sorted({type(m).__name__ for m in mixers})}),"
            f" which run on the whole sequence gathered over the SP group; with ring_size={ring_size} the shards are"
            " not contiguous. Use ring_size=1 for this architecture."
        )
    if ring_size > 1 and any(_calls_sdpa_directly(m) for m in model.modules()):
        raise ValueError(f"{name} computes attention itself (direct SDPA calls): not supported with"
                         f" ring_size={ring_size}; use ring_size=1.")
    sp_size = sp_size // ring_size  # the heads are split over the Ulysses ranks only
    # with ring_size > 1 every implementation runs the ring's own block kernels (ring.block_kernel), not flex's
    if impl == "flex_attention" and device_type == "cpu" and ring_size == 1:
        raise ValueError(
            f"{name} uses attn_implementation='flex_attention', which has no backward pass on CPU in this PyTorch."
            " Use attn_implementation='sdpa' on CPU (flex_attention works on CUDA)."
        )
    for config in _configs(model):
        heads = getattr(config, "num_attention_heads", None)
        if heads is None:
            continue
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads < sp_size:
            what = f"sp_size={sp_size}" if ring_size == 1 else f"the Ulysses part sp_size/ring_size={sp_size}"
            raise ValueError(
                f"{name} has num_attention_heads={heads}, fewer than {what}: some SP ranks would hold"
                f" no head. Use sp_size <= {heads}, or split the sequence further with ring attention:"
                f" `UlyssesDeepSpeedStrategy(sp_size=..., ring_size=r)` with sp_size / r <= {heads}."
            )
        if heads % kv_heads != 0:
            raise ValueError(
                f"{name} has num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads};"
                " Ulysses attention needs whole query groups per KV head."
            )


def supported_implementations(model: nn.Module) -> list[str]:
    """Which of the implementations Ulysses attention wraps the model's class supports (transformers' flags)."""
    cls = type(model)
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
             "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}
    return [impl for impl, flag in flags.items() if getattr(cls, flag, False)]

_ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention"}


# Class names of sequence mixers other than attention; any of them that the mixer exchange does not take (found by
# structure, see lightning_ulysses.mixers) is refused.
_MIXER_CLASS = re.compile(r"(mixer|deltanet|deltaattention|shortconv|linearattention|lightningattention|recurrent\w*"
                          r"|rglru\w*|rwkv\w*|ssm)$", re.IGNORECASE)


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has attention modules the Ulysses exchange serves."""
    return any(_uses_attention_interface(m) for m in model.modules())


def sequence_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that mix the sequence without attention and run on the gathered sequence under SP
    (:mod:`lightning_ulysses.mixers`)."""
    return find_sequence_mixers(model, _uses_attention_interface)


def _uses_attention_interface(module: nn.Module) -> bool:
    """An attention module that the Ulysses exchange serves (through transformers' interface or direct SDPA)."""
    if not re.search(r"Attention\d*$", type(module).__name__):
        return False
    source = _forward_source(module) or ""
    return ("ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source
            or "scaled_dot_product_attention(" in source)


def refuse_unsupported_architecture(model: nn.Module) -> None:
    """Raise a ``ValueError`` (before compute) for architectures whose training under SP would be silently wrong:

    * layers that mix the sequence without attention (linear attention, gated delta nets, Mamba/SSM, convolutions
      over the sequence): under SP they would see only the rank's shard;
    * attention modules that call SDPA themselves instead of transformers' attention interface (their attention
      would skip the exchange);
    * the MoE router's auxiliary load-balancing loss (``output_router_logits=True``), which transformers computes
      from this rank's tokens only.
    """
    name = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    kinds: set[str] = set()
    for config in _configs(model):
        for key in ("layer_types", "layers_block_type"):
            kinds.update(str(kind) for kind in (getattr(config, key, None) or []))
    other_kinds = sorted(kinds - _ATTENTION_LAYER_KINDS)
    mixers = sequence_mixers(model)
    covered = {id(m) for mixer in mixers for m in mixer.modules()}
    unknown = sorted({f"{module_name} ({type(module).__name__})" for module_name, module in model.named_modules()
                      if id(module) not in covered and _MIXER_CLASS.search(type(module).__name__)
                      and not _uses_attention_interface(module)})
    unknown += uncovered_sequence_convolutions(model, mixers)
    if unknown or (other_kinds and not mixers):
        raise ValueError(
            f"{name} mixes the sequence outside attention"
            + (f" (layer kinds {other_kinds})" if other_kinds and not mixers else "")
            + (f" in {unknown[:4]}{' ...' if len(unknown) > 4 else ''}" if unknown else "")
            + " in a way the strategy does not recognise (a sequence mixer owns an `A_log` parameter, a depthwise"
            " `nn.Conv1d` over the sequence or lightning attention's decay buffers). Under sequence parallelism"
            " those layers would see only this rank's shard of the sequence (a recurrence restarting at every"
            " shard, a convolution missing the previous shard's tokens) and train a different model without an"
            " error: train this architecture with sp_size=1."
        )
    bypassing = [module for module in model.modules()
                 if id(module) not in covered and _bypasses_attention_interface(module)]
    if bypassing:
        classes = sorted({type(module).__name__ for module in bypassing})
        impl = attention_implementation(model)
        if impl != "sdpa" or not all(_calls_sdpa_directly(module) for module in bypassing):
            raise ValueError(
                f"{name}: {classes} compute attention themselves instead of through transformers' attention"
                " interface; the strategy can put the Ulysses exchange around them only when they call torch's"
                f" scaled_dot_product_attention, i.e. with attn_implementation='sdpa' (this model: {impl!r})."
                " Build it with attn_implementation='sdpa', or train with sp_size=1."
            )
        if getattr(model.config, "alibi", False):
            raise ValueError(
                f"{name} uses ALiBi position biases (config.alibi=True), which it adds to the attention scores of"
                " each rank's shard outside any exchange. This architecture cannot train under sequence parallelism"
                " with ALiBi; use sp_size=1."
            )
    known = _KNOWN_UNSHARDABLE.get(getattr(model.config, "model_type", None))
    if known:
        raise ValueError(f"{name} {known}: UlyssesDeepSpeedStrategy's attention cannot shard that, so it cannot"
                         " train under sequence parallelism; use sp_size=1.")
    for config in _configs(model):
        if has_load_balancing_loss(model) or "aux_loss" not in (_forward_source(model) or "aux_loss"):
            break  # computed over the whole global batch (lightning_ulysses.moe), or not computed at all
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1.0):
            raise ValueError(
                f"{name} has output_router_logits=True: transformers computes the MoE load-balancing loss from the"
                " router statistics of this rank's tokens only, so under sequence parallelism its value and"
                " gradients differ from the whole batch's (and between ranks). Set `output_router_logits=False`"
                " (or `router_aux_loss_coef=0`) for training under SP."
            )


# Architectures whose attention takes inputs the exchange cannot shard, known before any compute (the attention
# function also refuses a mask that requires grad at the first forward, for models not listed here).
_KNOWN_UNSHARDABLE = {
    "doge": "passes a learned per-key bias (its dynamic mask) to attention through attention_mask",
    "qwen4_exp_text": "uses indexed attention (each query attends to the keys an indexer selects from the whole"
                      " sequence, through a full 4-D mask; its n-gram embeddings also read the tokens before a shard)",
}


def _forward_source(module: nn.Module) -> Optional[str]:
    return _class_forward_source(type(module))


@functools.lru_cache(maxsize=None)
def _class_forward_source(cls: type) -> Optional[str]:
    """The source of ``cls.forward``, read once per class (models hold one attention class per layer)."""
    import inspect

    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def _bypasses_attention_interface(module: nn.Module) -> bool:
    """An attention module (class name ending in ``Attention``/``Attention2``) whose forward never dispatches
    through transformers' attention interface."""
    import re

    if not re.search(r"Attention\d*$", type(module).__name__):
        return False
    source = _forward_source(module)
    if source is None:
        return False
    if any(_uses_attention_interface(m) for m in module.modules() if m is not module):
        return False  # a wrapper around the module that attends (BERT's BertAttention around BertSelfAttention)
    return not ("ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source)


def _calls_sdpa_directly(module: nn.Module) -> bool:
    source = _forward_source(module) or ""
    return _bypasses_attention_interface(module) and "scaled_dot_product_attention(" in source


def refuse_tuning_callbacks(callbacks: list) -> None:
    """Lightning's learning-rate finder (``Tuner.lr_find``) cannot drive a DeepSpeed engine: refuse it before compute,
    naming what to do instead (``Tuner.scale_batch_size`` is refused by Lightning itself for distributed runs)."""
    from lightning.pytorch.callbacks import LearningRateFinder

    for callback in callbacks:
        if isinstance(callback, LearningRateFinder):
            raise ValueError(
                "Tuner.lr_find / LearningRateFinder does not work with UlyssesDeepSpeedStrategy: DeepSpeed wraps the"
                " optimizer in its ZeRO optimizer, which Lightning's learning-rate finder cannot step (it fails"
                " inside Lightning/DeepSpeed with 'DeepSpeedZeroOptimizer is not an Optimizer'). Run the range test"
                " as a few short fits with different learning rates (e.g. `Trainer(max_steps=50)` per candidate,"
                " comparing `train_loss`), or find the rate on one device with `strategy='auto'` and a shorter"
                " sequence, then train with this strategy."
            )


def validate_litgpt_model(model: nn.Module, sp_size: int, ring_size: int) -> None:
    """A LitGPT ``GPT`` under SP: Ulysses only, at least one head per rank, no sliding-window layers."""
    config = model.config
    name = f"LitGPT GPT ({getattr(config, 'name', '') or 'custom config'})"
    if ring_size > 1:
        raise ValueError(f"{name}: LitGPT models are supported with ring_size=1 (Ulysses) only.")
    if config.n_head < sp_size:
        raise ValueError(f"{name} has n_head={config.n_head}, fewer than sp_size={sp_size}: use sp_size <= "
                         f"{config.n_head}.")
    if getattr(config, "sliding_window_size", None):
        raise ValueError(f"{name} has sliding-window layers (sliding_window_size={config.sliding_window_size}),"
                         " whose mask LitGPT builds for the local sequence: not supported under sequence"
                         " parallelism yet.")

"""What a Hugging Face model must be to train under SP, checked before any compute: a supported attention
implementation, heads that split over the Ulysses ranks, and no way of mixing the sequence that the strategy cannot
make exact. Every refusal is a ``ValueError`` that says why and what to change.

Sequence mixers other than attention are not refused as such: :mod:`lightning_ulysses.models.mixers` finds them by
structure (an ``A_log`` parameter, a depthwise convolution over the sequence, lightning attention's decay buffer) and
runs them on the whole sequence, split by heads by the families of :mod:`lightning_ulysses.families.mixers` (gated
delta nets, Kimi's delta attention, Mamba2 and Mamba1 mixers, lightning attention, short convolutions) or whole on
every rank. Refused are:

* a layer that mixes the sequence but that structure does not find (a class named like a mixer, a layer kind other
  than attention in the config, a convolution over the sequence outside every found mixer);
* attention modules that compute attention themselves instead of through transformers' attention interface, unless
  they call torch's SDPA and the model runs with ``attn_implementation='sdpa'`` (the strategy then puts the exchange
  around those calls, :mod:`lightning_ulysses.models.hf`); with ALiBi biases even then;
* model types whose attention takes inputs the exchange cannot shard (:data:`KNOWN_UNSHARDABLE`: learned mask
  biases, indexed attention);
* an MoE router loss that transformers would compute from this rank's tokens only (one that
  :mod:`lightning_ulysses.models.moe` does not make exact).

How a model is classified never depends on reading the source of its forward (a wrapped or compiled forward would
hide it): attention modules are found by class name (``...Attention``, ``...Attention2``), and what they do is decided
by their modeling module, their structure and two explicit tables (:func:`_attention_kind`); the router loss by the
config and the names the modeling module defines (:func:`_router_loss_per_shard`).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from types import ModuleType
from typing import Any, Iterator, Optional

from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.families.attention_classes import CALLS_SDPA_ITSELF, NOT_THROUGH_INTERFACE
from lightning_ulysses.families.mixers import MIXER_CLASS_NAME
from lightning_ulysses.families.unshardable import KNOWN_UNSHARDABLE
from lightning_ulysses.models import litgpt
from lightning_ulysses.models.hf_attention import ATTENTION_PREFIX, SUPPORTED_ATTENTION, attention_implementation
from lightning_ulysses.models.mixers import find_sequence_mixers, is_sequence_mixer, uncovered_sequence_convolutions
from lightning_ulysses.models.moe import has_load_balancing_loss


# Sub-models that attend over their own inputs (image patches), never over sequence shards: their heads are not split.
_LOCAL_SUB_CONFIGS = ("vision_config",)


def _configs(model: nn.Module) -> Iterator[Any]:
    """The model's config and the sub-configs of the parts that run on sequence shards."""
    config = model.config
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        if key in _LOCAL_SUB_CONFIGS:
            continue
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def validate_model(model: nn.Module, sp_size: int, device_type: str, ring_size: int = 1) -> None:
    """Raise a ``ValueError`` (before any compute) if ``model`` cannot run Ulysses attention at ``sp_size`` (the
    Ulysses part of it: ``sp_size / ring_size`` ranks share the heads)."""
    name = type(model).__name__
    impl = _compat.attention_implementation(model.config)
    if impl is not None and impl.startswith(ATTENTION_PREFIX):
        impl = impl[len(ATTENTION_PREFIX) :]
    if not has_attention(model) and sequence_mixers(model):  # a pure state-space model: no attention to shard
        refuse_unsupported_architecture(model)
        if ring_size > 1:
            raise ValueError(f"{name} has no attention, only sequence mixers: use ring_size=1.")
        return
    if not has_attention(model) and not calls_sdpa_anywhere(model) and not supported_implementations(model):
        raise ValueError(
            f"{name} mixes the sequence without attention through transformers' attention interface and without a"
            f" sequence mixer the strategy's mixer exchange takes (its layers hold {_layer_parts(model)}: a"
            " recurrence such as RWKV's time mixing or xLSTM's cells). Under sequence parallelism each rank would"
            " run it over its own shard only, so it cannot train sequence-parallel, whatever attn_implementation it"
            " is built with. Train it with sp_size=1 (e.g. `DeepSpeedStrategy`), which holds the whole sequence."
        )
    if impl not in SUPPORTED_ATTENTION and not (impl == "eager" and has_attention_sinks(model)):
        usable = supported_implementations(model)
        if device_type == "cpu" and usable and "sdpa" not in usable:
            raise ValueError(
                f"{name} uses attn_implementation={impl!r}, which UlyssesDeepSpeedStrategy cannot shard, and of the"
                f" implementations it shards {name} supports only {usable}, which run on CUDA: on CPU it cannot"
                " train under sequence parallelism (only 'sdpa' runs there). On GPUs, build it with"
                f" `attn_implementation={usable[0]!r}`; on CPU, train it with sp_size=1."
            )
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
    if ring_size > 1 and any(calls_sdpa_directly(m) for m in model.modules()):
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


def has_attention_sinks(model: nn.Module) -> bool:
    """Attention through transformers' interface with per-head sink logits (GPT-OSS's ``sinks``, passed as
    ``s_aux``): Ulysses attention computes it with its own sink kernel (:mod:`lightning_ulysses.parallel.sinks`),
    whatever implementation the model was built with (GPT-OSS's eager one on CPU)."""
    return any(isinstance(getattr(m, "sinks", None), nn.Parameter) and _attention_kind(m) == "interface"
               for m in model.modules())


def calls_sdpa_anywhere(model: nn.Module) -> bool:
    return any(calls_sdpa_directly(m) for m in model.modules())


def _layer_parts(model: nn.Module) -> list[str]:
    """The class names of the first layer's parts that are not norms, linears, dropouts or activations."""
    plain = ("Norm", "Linear", "Dropout", "Embedding", "Activation", "GELU", "SiLU", "Identity")
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            parts = sorted({type(m).__name__ for m in module[0].modules() if m is not module[0]
                            and not any(word in type(m).__name__ for word in plain)})
            return parts or [type(module[0]).__name__]
    return [type(model).__name__]


def supported_implementations(model: nn.Module) -> list[str]:
    """Which of the implementations Ulysses attention wraps the model's class supports (transformers' flags)."""
    cls = type(model)
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
             "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}
    return [impl for impl, flag in flags.items() if getattr(cls, flag, False)]

_ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}  # (chunks: hf_attention.py)


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has attention modules the Ulysses exchange serves."""
    return any(_uses_attention_interface(m) for m in model.modules())


def sequence_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that mix the sequence without attention and run on the gathered sequence under SP
    (:mod:`lightning_ulysses.models.mixers`)."""
    return find_sequence_mixers(model, _uses_attention_interface)


def _uses_attention_interface(module: nn.Module) -> bool:
    """An attention module that the Ulysses exchange serves (through transformers' interface or direct SDPA)."""
    return _attention_kind(module) in ("interface", "sdpa")


def refuse_unsupported_architecture(model: nn.Module) -> None:
    """Raise a ``ValueError`` (before compute) for architectures whose training under SP would be silently wrong:

    * layers that mix the sequence in a way :mod:`lightning_ulysses.models.mixers` does not find (see the module
      docstring): under SP they would see only the rank's shard;
    * attention modules that compute attention themselves instead of through transformers' attention interface
      (their attention would skip the exchange), unless they call torch's SDPA under ``attn_implementation='sdpa'``
      without ALiBi;
    * model types in :data:`KNOWN_UNSHARDABLE`;
    * an MoE router loss (``output_router_logits=True``) that transformers computes from this rank's tokens only,
      i.e. one that is not ``load_balancing_loss_func`` of the model's modeling module.
    """
    name = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    known = KNOWN_UNSHARDABLE.get(getattr(model.config, "model_type", None))
    if known:  # named by what the model has, before any generic rule
        raise ValueError(f"{name} {known}: UlyssesDeepSpeedStrategy's attention cannot shard that, so it cannot"
                         " train under sequence parallelism; use sp_size=1.")
    kinds: set[str] = set()
    for config in _configs(model):
        for key in ("layer_types", "layers_block_type"):
            kinds.update(str(kind) for kind in (getattr(config, key, None) or []))
    other_kinds = sorted(kinds - _ATTENTION_LAYER_KINDS)
    mixers = sequence_mixers(model)
    covered = {id(m) for mixer in mixers for m in mixer.modules()}
    unknown = sorted({f"{module_name} ({type(module).__name__})" for module_name, module in model.named_modules()
                      if id(module) not in covered and MIXER_CLASS_NAME.search(type(module).__name__)
                      and not _uses_attention_interface(module)})
    unknown += uncovered_sequence_convolutions(model, mixers)
    if unknown or (other_kinds and not mixers):
        raise ValueError(
            f"{name} mixes the sequence outside attention"
            + (f" (layer kinds {other_kinds})" if other_kinds and not mixers else "")
            + (f" in {unknown[:4]}{' ...' if len(unknown) > 4 else ''}" if unknown else "")
            + " in a way the strategy does not recognise (the mixers its exchange takes own an `A_log` parameter, a"
            " depthwise `nn.Conv1d` over the sequence or lightning attention's decay buffers; these do not). Under"
            " sequence parallelism"
            " those layers would see only this rank's shard of the sequence (a recurrence restarting at every"
            " shard, a convolution missing the previous shard's tokens) and train a different model without an"
            " error: train this architecture with sp_size=1."
        )
    bypassing = [module for module in model.modules()
                 if id(module) not in covered and _bypasses_attention_interface(module)]
    if bypassing:
        classes = sorted({type(module).__name__ for module in bypassing})
        impl = attention_implementation(model)
        if impl != "sdpa" or not all(calls_sdpa_directly(module) for module in bypassing):
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
    known = KNOWN_UNSHARDABLE.get(getattr(model.config, "model_type", None))
    if known:
        raise ValueError(f"{name} {known}: UlyssesDeepSpeedStrategy's attention cannot shard that, so it cannot"
                         " train under sequence parallelism; use sp_size=1.")
    if not _router_loss_per_shard(model):
        return  # computed over the whole global batch (lightning_ulysses.models.moe), or not computed at all
    for config in _configs(model):
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1.0):
            raise ValueError(
                f"{name} has output_router_logits=True: transformers computes the MoE load-balancing loss from the"
                " router statistics of this rank's tokens only, so under sequence parallelism its value and"
                " gradients differ from the whole batch's (and between ranks). Set `output_router_logits=False`"
                " (or `router_aux_loss_coef=0`) for training under SP."
            )


# ----------------------------------------------------------------------------------------------- attention modules
_ATTENTION_CLASS = re.compile(r"Attention\d*$")  # transformers' naming: LlamaAttention, BertSelfAttention, ...

# What a forward that looks its kernel up in transformers' attention interface reads: the registry, and the eager
# function it falls back to (every modeling module's attention does both, whatever its class is called).
_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")


@functools.lru_cache(maxsize=None)
def _forward_dispatches_attention(cls: type) -> bool:
    """Whether the ``forward`` instances of ``cls`` run (its own or inherited: a wrapper on one instance changes
    nothing) looks its attention kernel up in transformers' attention interface. Read from the forward's source;
    a forward without source (compiled, generated) is not recognised this way."""
    forward = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(marker in source for marker in _DISPATCH_MARKERS)


def _is_attention_class(cls: type) -> bool:
    """An attention module's class: one whose forward dispatches through transformers' attention interface (what it
    does: LongcatFlashMLA, or a subclass of an attention class under another name), or one named as transformers
    names its attention classes (``LlamaAttention``, ``BertSelfAttention``: those that compute attention in their
    own way, which the rules of :func:`_attention_kind` then refuse or serve)."""
    return _forward_dispatches_attention(cls) or bool(_ATTENTION_CLASS.search(cls.__name__))


def _own_classes(cls: type) -> list[type]:
    """``cls`` and its bases up to ``nn.Module`` (exclusive): the classes a model's authors wrote."""
    return [c for c in cls.__mro__ if c not in nn.Module.__mro__]


def _attention_kind(module: nn.Module) -> Optional[str]:
    """What an attention module does with its q, k and v, decided without reading its forward:

    * ``"sdpa"``: it calls torch's SDPA itself (its class, or a base class, is in :data:`CALLS_SDPA_ITSELF`);
    * ``"interface"``: it looks its kernel up in transformers' attention interface, i.e. it is not listed in
      :data:`NOT_THROUGH_INTERFACE`, its class (or a base class) is defined in a modeling module that has
      ``ALL_ATTENTION_FUNCTIONS``, it holds a ``config`` (the lookup reads ``config._attn_implementation``), it is no
      sequence mixer, and no attention module inside it dispatches (else it is a wrapper around that one);
    * ``"own"``: any other attention module, which computes attention some other way;
    * ``None``: not an attention module (its forward does not dispatch through the interface and its class name does
      not end in ``Attention`` / ``Attention<n>``).

    Wrapping or compiling the forward changes none of these facts.
    """
    cls = type(module)
    if not _is_attention_class(cls):
        return None
    for base in _own_classes(cls):
        if base.__name__ in CALLS_SDPA_ITSELF:
            return "sdpa"
        if base.__name__ in NOT_THROUGH_INTERFACE:
            return "own"
    next_to_interface = any(hasattr(sys.modules.get(base.__module__), "ALL_ATTENTION_FUNCTIONS")
                            for base in _own_classes(cls))
    if not next_to_interface or not hasattr(module, "config") or is_sequence_mixer(module):
        return "own"
    if any(_attention_kind(inner) == "interface" for inner in module.modules() if inner is not module):
        return "own"  # a wrapper: the module inside it attends
    return "interface"


def _bypasses_attention_interface(module: nn.Module) -> bool:
    """An attention module (class name ending in ``Attention``/``Attention2``) that computes attention without
    transformers' attention interface, and is no wrapper around a module that the exchange serves (BERT's
    BertAttention around BertSelfAttention)."""
    if _attention_kind(module) not in ("sdpa", "own"):
        return False
    return not any(_uses_attention_interface(m) for m in module.modules() if m is not module)


def calls_sdpa_directly(module: nn.Module) -> bool:
    return _attention_kind(module) == "sdpa" and _bypasses_attention_interface(module)


# ----------------------------------------------------------------------------------------------- the router loss
# Module-level names under which a modeling module defines an MoE router loss (transformers' families:
# load_balancing_loss_func; switch_transformers also router_z_loss_func).
_ROUTER_LOSS_NAME = re.compile(r"aux\w*loss|balanc\w*loss|router\w*loss|z_loss", re.IGNORECASE)


def _modeling_modules(cls: type) -> list[ModuleType]:
    """The modeling modules (``modeling_<name>``: transformers' and remote code's) of ``cls`` and its bases."""
    modules: list[ModuleType] = []
    for base in _own_classes(cls):
        module = sys.modules.get(base.__module__)
        if module is not None and base.__module__.rpartition(".")[2].startswith("modeling_") \
                and module not in modules:
            modules.append(module)
    return modules


def _router_loss_per_shard(model: nn.Module) -> bool:
    """Whether ``model`` computes an MoE router loss that would see only this rank's tokens: one of its modeling
    modules (its class's or a base class's) defines a router loss function, and it is not the
    ``load_balancing_loss_func`` of the model's own modeling module, which :mod:`lightning_ulysses.models.moe`
    replaces by the global batch's. (Models whose modeling module defines none compute no router loss: their
    ``output_router_logits`` only returns the logits.)"""
    if has_load_balancing_loss(model):
        return False
    return any(callable(value) and _ROUTER_LOSS_NAME.search(name)
               for module in _modeling_modules(type(model)) for name, value in vars(module).items())


def refuse_weight_averaging_on_partitioned_parameters(callbacks: list, module: nn.Module,
                                                      deepspeed_config: dict) -> None:
    """Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) keeps an ``AveragedModel`` copy of the whole module,
    updated from the module's parameters after every optimizer step. At ZeRO-3 a parameter larger than
    ``stage3_param_persistence_threshold`` is partitioned: the module holds a ``[0]`` placeholder outside forward,
    and the first update fails after the first optimizer step (a weight already changed). Refused before the engine
    exists; ZeRO-3 with every parameter below the threshold (nothing partitioned) and ZeRO 0-2 train exactly."""
    from lightning.pytorch.callbacks import WeightAveraging

    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage", 0) != 3 or not any(isinstance(c, WeightAveraging) for c in callbacks):
        return
    threshold = zero.get("stage3_param_persistence_threshold", 100_000)
    partitioned = [name for name, p in module.named_parameters() if p.numel() > threshold]
    if partitioned:
        raise ValueError(
            f"{type(next(c for c in callbacks if isinstance(c, WeightAveraging))).__name__} keeps a whole copy of the"
            " model and updates it from the model's parameters after every optimizer step, but at ZeRO stage 3"
            f" {len(partitioned)} parameters (e.g. `{partitioned[0]}`, above stage3_param_persistence_threshold="
            f"{threshold}) are partitioned across the ranks: the update would fail after the first optimizer step,"
            " with a weight already changed. Nothing was trained. Train with ZeRO stage 2 (`stage=2`), where the"
            " weight averaging is exact under sequence parallelism, or keep the average yourself from"
            " `deepspeed.zero.GatheredParameters` in a callback."
        )


def refuse_compile_wrapper_at_zero3(module: nn.Module, deepspeed_config: dict) -> None:
    """``torch.compile(model)`` returns a wrapper (``OptimizedModule``) whose attribute writes go to the wrapped
    module. DeepSpeed ZeRO-3 swaps every module's ``_parameters`` for its own dict and marks it in each forward; on
    the wrapper the swap lands on the wrapped module, and the first forward fails inside DeepSpeed (``'dict' object
    has no attribute '_in_forward'``, DeepSpeed alone, with or without sequence parallelism). Refused before the
    engine exists. ``model.compile()`` (in place, no wrapper) trains exactly at ZeRO-3, and the wrapper at ZeRO 0-2
    (``tests/test_compile.py``)."""
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage", 0) != 3:
        return
    wrapper = _compat.compile_wrapper_class()
    if wrapper is None:  # a PyTorch without dynamo: nothing can be compiled
        return
    wrapped = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, wrapper)]
    if wrapped:
        name, sub = wrapped[0]
        inner = type(getattr(sub, "_orig_mod", sub)).__name__
        attribute = f"self.{name}" if name else "the module"
        raise ValueError(
            f"`{attribute}` is a `torch.compile(...)` wrapper (OptimizedModule around {inner}), which DeepSpeed ZeRO"
            " stage 3 (`stage=3`) cannot run: its forward fails inside DeepSpeed ('dict' object has no attribute"
            " '_in_forward') before the first step. Nothing was trained. Compile in place instead: keep the module"
            f" and call `{attribute}.compile()` (nn.Module.compile, the same compiled forward without a wrapper),"
            " which trains exactly at ZeRO-3 under sequence parallelism; or keep `torch.compile(...)` and train with"
            " ZeRO stage 2 (`stage=2`)."
        )


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
    changed = litgpt.changed_attention_kernels(model)
    if changed:
        raise ValueError(
            f"{name} ({type(model).__module__}.{type(model).__name__}) computes attention in {', '.join(changed)},"
            " not in LitGPT's own kernel (an adapter's prefix attention, sized for all heads): the strategy runs"
            " LitGPT's kernel over the whole sequence on this rank's heads and cannot split another one. Supported:"
            " litgpt.model.GPT (full fine-tuning, pretraining) and litgpt.lora.GPT (LoRA)."
        )


def refuse_hf_only_switches(what: str, models: list[nn.Module], switches: list[str]) -> None:
    """The memory switches and ``offload_attention`` are run by the strategy inside Hugging Face models only (their
    MLPs, their loss, their attention functions, their checkpointing): with another kind of model they would do
    nothing while the run believes them on. Refused before compute, naming them."""
    if models and switches:
        names = ", ".join(sorted({type(model).__name__ for model in models}))
        one = len(switches) == 1
        raise ValueError(
            f"{', '.join(switches)} {'is' if one else 'are'} run inside Hugging Face models only; this module has"
            f" {what} ({names}), which would train without {'it' if one else 'them'}. Turn {', '.join(switches)}"
            " off, or use the transformers model of the same family."
        )

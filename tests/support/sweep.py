"""The sweep over every ``*ForCausalLM`` of the installed transformers (``benchmarks/causal_lm_sweep.py``,
``tests/test_causal_lm_sweep.py``): which classes there are, each built tiny from its config class's defaults shrunk
generically, the single-process reference fit and the comparison with an SP fit.

Shrinking: every size attribute the config has is set small (hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim
16, intermediate 128, vocabulary 128, windows of 8 tokens, 4 experts / 2 per token, LoRA ranks 16, ...), nested
configs (``text_config``, ``vision_config``, ...) the same way, per-layer lists (``layer_types``,
``mlp_layer_types``, ...) cut to one layer of each kind, dropout 0, ``use_cache`` off; ``OVERRIDES``: what that
cannot guess, per model type. A model type (or a composite model's text part) that ``tests/support/architectures.py``
has a hand-made configuration for uses that one instead (known to build). Built with ``attn_implementation="sdpa"``
where the class supports it, otherwise its default; fp32.

``batches`` (re-exported): the training rows, as the hand-made matrix's (``[1, 32]``, labels = input_ids).
"""

from __future__ import annotations

import functools
import json
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from tests.support.architectures import ARCHITECTURES, VOCAB, batches

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "causal_lm_sweep.json"
TABLE = REPO_ROOT / "docs" / "causal-lm-sweep.md"
COMMAND = "python benchmarks/causal_lm_sweep.py"
STEPS, LR = 3, 0.5
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4
MAX_PARAMS = 20_000_000  # a model still bigger than this after shrinking: the shrinking missed a size

# outcomes
EXACT, REFUSED, WRONG, CRASHED, NOT_BUILDING = "exact", "refused", "WRONG", "crashed", "does not build on CPU"
NOT_APPLICABLE, NOT_RUN = "n/a", "-"

# settings (the table's columns): ZeRO 2 fp32 (the base row), ZeRO 3 with every parameter partitioned
# (stage3_param_persistence_threshold=0), bf16 (Lightning's bf16-mixed at ZeRO 2: bf16 weights, float32 master
# weights; criterion against float64: at most BF16_RATIO times one device's bf16 error), packed rows (several
# documents per row, sdpa_per_document=True, where transformers' own forward keeps them apart), and bf16 with packed
# rows
ZERO2, ZERO3, BF16, PACKED, BF16_PACKED = "zero2", "zero3", "bf16", "packed", "bf16_packed"
SETTINGS = (ZERO2, ZERO3, BF16, PACKED, BF16_PACKED)  # BF16_PACKED: both at once
BF16_RATIO = 2.0
PACKED_DOCUMENTS = [[10, 22], [20, 12], [6, 17, 9]]  # document lengths of each step's 32-token row

# attribute -> value, set wherever the config (or a nested config) has the attribute with a value of that kind
_HIDDEN = ["hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "attention_hidden_size", "lru_width",
           "input_embedding_size", "output_embedding_size", "backbone_hidden_size", "router_hidden_size"]
_LAYERS = ["num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers"]
_HEADS = ["num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
          "encoder_attention_heads", "linear_num_heads", "linear_num_value_heads", "indexer_n_heads"]
_KV_HEADS = ["num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num",
             "linear_num_key_heads"]
_HEAD_DIM = ["head_dim", "kv_channels", "attention_head_dim", "dim_head", "swa_head_dim", "global_head_dim",
             "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
             "indexer_head_dim", "mamba_head_dim", "mamba_headdim", "mamba_d_head", "qk_head_dim"]
_FFN = ["intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size", "d_ff",
        "dim_ff", "dff", "intermediate_size_mlp", "feed_forward_size", "dense_intermediate_size",
        "shared_intermediate_size", "d_inner"]
_MOE_FFN = ["moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
            "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "expert_intermediate_size"]
_EXPERTS = ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"]
_PER_TOKEN = ["num_experts_per_tok", "moe_top_k", "num_experts_per_token", "num_selected_experts"]
_POSITIONS = ["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_target_positions",
              "max_source_positions", "context_length", "original_max_position_embeddings", "model_max_length"]
_WINDOWS = ["sliding_window", "window_size", "attention_window_size", "sliding_window_size", "attention_chunk_size",
            "local_attention_window_len"]
_VOCABS = ["vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size"]
SIZES: dict[str, int] = {
    **dict.fromkeys(_HIDDEN, 64), **dict.fromkeys(_LAYERS, 2), **dict.fromkeys(_HEADS, 4),
    **dict.fromkeys(_KV_HEADS, 2), **dict.fromkeys(_HEAD_DIM, 16), **dict.fromkeys(_FFN, 128),
    **dict.fromkeys(_MOE_FFN, 32), **dict.fromkeys(_EXPERTS, 4), **dict.fromkeys(_PER_TOKEN, 2),
    **dict.fromkeys(_POSITIONS, 256), **dict.fromkeys(_WINDOWS, 8), **dict.fromkeys(_VOCABS, VOCAB),
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "index_topk": 8, "index_n_heads": 2,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 8, "mamba_d_state": 16, "state_size": 16,
    "ssm_state_size": 16, "mamba_d_ssm": 128, "mamba_chunk_size": 32, "chunk_size": 32, "mamba_n_groups": 1,
    "mamba_ngroups": 1, "hidden_size_per_layer_input": 16, "mm_tokens_per_image": 4, "image_size": 32,
    "patch_size": 8, "num_channels": 3, "projection_dim": 64, "mamba_d_conv": 4, "conv_kernel": 4,
    "linear_conv_kernel_dim": 4, "block_size": 8, "moe_k": 2, "num_expert_group": 1, "rotary_dim": 8,
    "num_codebooks": 1, "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 128, "attention_head_size": 16,
    "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64,
}
# head sizes kept in the family's ratios (family_head_sizes): the largest of them
_HEAD_SIZES = [*_HEAD_DIM, "qk_rope_head_dim", "qk_nope_head_dim"]
LARGEST_HEAD = 32
# set even where the default is None (None there means "off" or "derive it", and an MoE of 4 experts / a head_dim
# of hidden / heads is what the shrunk model has anyway)
SET_IF_NONE = {"head_dim", *_EXPERTS, *_PER_TOKEN, *_MOE_FFN}
# what the generic shrinking cannot guess, per model_type (applied after it)
OVERRIDES: dict[str, dict[str, Any]] = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "deepseek_v32": {"num_key_value_heads": 4},  # its hand-made (refusal) config: MLA keys are per head
    "gptj": {"rotary_dim": 8},  # its hand-made (refusal) config: rotary_dim must fit head_dim 16
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    "dots1": {"n_shared_experts": 1},
    # one sliding, one MLP-only, one full layer: one of each of its input / recurrent / output stacks
    # (its config counts an attention and an MLP block as one layer each, then halves the counts)
    "dory": {"_keep_layers": [0, 1, 2, 3, 6, 7], "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2},
    # sequences of 4 x 8 axial positions, chunks of 8
    "reformer": {"axial_pos_shape": [4, 8], "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 8,
                 "lsh_attn_chunk_length": 8, "num_buckets": 4},
    # rope on a quarter of head_dim (partial_rotary_factor 0.25) = qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 12, "per_layer_config": {
        1: {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 12}}},
    # a sliding and a full layer twice: the last two share the KV of the first two
    "gemma3n_text": {"_keep_layers": [0, 4, 5, 9], "num_kv_shared_layers": 2},
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def causal_lm_classes() -> dict[str, str]:
    """model_type -> class name: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` plus every other ``*ForCausalLM`` that
    ``transformers`` exports (keyed by its config class's ``model_type``)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    classes = {t: (c[0] if isinstance(c, (list, tuple)) else c) for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    mapped = set(classes.values())
    for name in sorted(dir(transformers)):
        if name.endswith("ForCausalLM") and not name.startswith("Auto") and name not in mapped:
            cls = getattr(transformers, name)
            config_class = getattr(cls, "config_class", None)
            model_type = getattr(config_class, "model_type", None) or name
            classes.setdefault(model_type, name)
    return dict(sorted(classes.items()))


def hand_made(model_type: str) -> Optional[str]:
    """The ``tests/support/architectures.py`` entry reused for ``model_type``: the one of that name, else the first
    of that type that trains, else the first of that type."""
    if model_type in ARCHITECTURES and ARCHITECTURES[model_type]["type"] == model_type:
        return model_type
    same = [n for n, e in ARCHITECTURES.items() if e["type"] == model_type]
    return next((n for n in same if "expect" not in ARCHITECTURES[n]), same[0] if same else None)


def _config_class(model_type: str, class_name: str):
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    return getattr(transformers, class_name).config_class


def _small(key: str, value: Any) -> Any:
    """``value`` shrunk if ``key`` is a size (also a per-layer list of sizes); else ``value`` unchanged."""
    if key in SIZES:
        if isinstance(value, int) and not isinstance(value, bool) or value is None and key in SET_IF_NONE:
            return SIZES[key]
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [SIZES[key]] * len(value)
    if key in TOKEN_IDS and value is not None:
        return [TOKEN_IDS[key]] if isinstance(value, list) else TOKEN_IDS[key]
    if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
        return 0.0
    if key == "tie_word_embeddings" and value:
        return False
    if key == "is_decoder":  # a causal LM (BERT-like encoders built as decoders)
        return True
    return value


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def family_head_sizes(defaults: dict[str, Any]) -> dict[str, int]:
    """The family's head sizes shrunk together, keeping their ratios: where the full config has head sizes of more
    than one value (query/key heads against value heads, a linear-attention or Mamba head against an attention head,
    the rotary and the position-free parts of a latent-attention key), the largest becomes ``LARGEST_HEAD`` and the
    others keep their ratio to it (multiples of 4); ``qk_head_dim`` stays the sum of its two parts. Empty where the
    family has one head size (then every head size is ``SIZES["head_dim"]``)."""
    sizes = {k: v for k in _HEAD_SIZES if _is_size(v := defaults.get(k))}
    if len(set(sizes.values())) < 2:
        return {}
    largest = max(sizes.values())
    out = {k: max(4, 4 * round(v * LARGEST_HEAD / largest / 4)) for k, v in sizes.items()}
    if "qk_head_dim" in out and "qk_rope_head_dim" in out and "qk_nope_head_dim" in out:
        out["qk_head_dim"] = out["qk_rope_head_dim"] + out["qk_nope_head_dim"]
    return out


def _small_values(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Every size of ``values`` shrunk; ``defaults``: the full config's values (for the ratios kept)."""
    out = {k: small for k, v in values.items() if (small := _small(k, v)) != v or k in SIZES}
    heads_kept = family_head_sizes(defaults)
    out.update({k: v for k, v in heads_kept.items() if k in values})
    if "kv_lora_rank" in defaults:  # multi-head latent attention: one key per head; rope on qk_rope_head_dim
        heads = out.get("num_attention_heads", SIZES["num_attention_heads"])
        for key in _KV_HEADS:
            if key in out:
                out[key] = heads
        rope, head_dim = defaults.get("qk_rope_head_dim"), defaults.get("head_dim")
        if "head_dim" in out and "head_dim" not in heads_kept and _is_size(rope) and _is_size(head_dim):
            # the rotary part of head_dim (partial_rotary_factor) stays the qk_rope_head_dim
            out["head_dim"] = out.get("qk_rope_head_dim", SIZES["qk_rope_head_dim"]) * max(1, head_dim // rope)
    return out


def _shrunk_kwargs(config, keep: Optional[list[int]] = None) -> dict[str, Any]:
    """Constructor arguments that shrink the (default-built) ``config``; nested configs shrunk the same way.
    ``keep``: the layers kept (default: the first of each kind of ``layer_types``, at least 2)."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    kwargs = _small_values(values, values)
    layers_key = next((k for k in _LAYERS if isinstance(values.get(k), int)), None)
    layers = values.get(layers_key) if layers_key else None
    if layers_key and layers:
        kinds = values.get("layer_types")
        if keep is None and isinstance(kinds, list) and len(kinds) == layers:
            keep = sorted({kinds.index(k) for k in kinds})  # one layer of each kind
        if keep is None:
            keep = []
        keep = (keep + [i for i in range(layers) if i not in keep])[:max(2, len(keep))]
        kwargs[layers_key] = len(keep)
        for key, value in values.items():  # every per-layer list cut to the layers kept
            if isinstance(value, list) and len(value) == layers:
                kwargs[key] = [kwargs.get(key, value)[i] for i in keep]
        per_layer = values.get("per_layer_config")
        if isinstance(per_layer, dict):  # heterogeneous layers: the overrides of the layers kept, shrunk
            kwargs["per_layer_config"] = {
                new: _small_values(per_layer[old], values) for new, old in enumerate(keep) for old in
                [next((k for k in per_layer if int(k) == old), None)] if old is not None}
    for key, sub in list(vars(config).items()):  # not getattr: per-layer configs refuse global reads
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = _sub_config(sub).to_dict()
    return kwargs


def _with_overrides(config_class, model_type: str):
    overrides = dict(OVERRIDES.get(model_type, {}))
    keep = overrides.pop("_keep_layers", None)
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - defaults its own validator refuses: with the overrides
        default = config_class(**overrides)
    return config_class(**{**_shrunk_kwargs(default, keep), **overrides})


def _sub_config(config):
    """A nested config shrunk: the hand-made one of its model_type where there is one."""
    name = hand_made(getattr(config, "model_type", ""))
    if name is not None:
        from tests.support.architectures import build_config

        return build_config(name)
    return _with_overrides(type(config), config.model_type)


def sweep_config(model_type: str, class_name: Optional[str] = None):
    """The tiny config of ``model_type``: the hand-made one where there is one, else the defaults shrunk."""
    name = hand_made(model_type)
    if name is not None:
        from tests.support.architectures import build_config

        config = build_config(name)
        for key, value in OVERRIDES.get(model_type, {}).items():
            setattr(config, key, value)
        return config
    config = _with_overrides(_config_class(model_type, class_name or causal_lm_classes()[model_type]), model_type)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def model_class(class_name: str):
    import transformers

    return getattr(transformers, class_name)


def attn_implementation(class_name: str) -> Optional[str]:
    """``"sdpa"`` where the class supports it, else None (its default)."""
    return "sdpa" if getattr(model_class(class_name), "_supports_sdpa", False) else None


def build(model_type: str, class_name: Optional[str] = None, seed: int = 0) -> torch.nn.Module:
    class_name = class_name or causal_lm_classes()[model_type]
    config = sweep_config(model_type, class_name)
    attn = attn_implementation(class_name)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    cls = model_class(class_name)
    if not isinstance(config, cls.config_class):  # a composite config (as AutoModelForCausalLM: its text part)
        config = next((sub for key in getattr(config, "sub_configs", {})
                       if isinstance(sub := getattr(config, key, None), cls.config_class)), config)
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in cls._from_config(config, **kwargs).parameters())
    except Exception:  # noqa: BLE001 - some models cannot be built on the meta device; count on CPU then
        size = None
    if size is not None and size > MAX_PARAMS:
        raise ValueError(f"still {size / 1e6:.0f}M parameters after shrinking (limit {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(seed)
    model = cls._from_config(config, **kwargs).float()
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):  # X-MOD: one adapter
        model.set_default_language(config.languages[0])
    return model


@functools.lru_cache(maxsize=None)
def hand_made_parts(model_type: str) -> tuple[str, ...]:
    """The hand-made entries the tiny config of ``model_type`` uses: its own, or its nested configs' (a composite
    model whose text model has one)."""
    if hand_made(model_type) is not None:
        return (hand_made(model_type),)
    try:
        config = sweep_config(model_type)
    except Exception:  # noqa: BLE001 - does not build: no parts
        return ()
    subs = [getattr(v, "model_type", "") for v in vars(config).values() if hasattr(v, "to_dict")]
    return tuple(n for n in (hand_made(t) for t in subs) if n is not None)


def _from_hand_made(model_type: str, key: str, default: Any) -> Any:
    """``key`` of the hand-made entries used (the first that sets it; for ``update_tol`` the largest)."""
    values = [ARCHITECTURES[n][key] for n in hand_made_parts(model_type) if key in ARCHITECTURES[n]]
    if not values:
        return default
    return max(values) if key == "update_tol" else values[0]


def lr_for(model_type: str) -> float:
    return _from_hand_made(model_type, "lr", LR)


def update_tol_for(model_type: str) -> float:
    return _from_hand_made(model_type, "update_tol", UPDATE_TOL)


def forward_kwargs(model_type: str) -> dict:
    return _from_hand_made(model_type, "forward", {})


def first_line(err: BaseException, limit: int = 200) -> str:
    """``Type: message``, its first line (and the next where the first ends with a colon)."""
    lines = [line.strip() for line in f"{type(err).__name__}: {err}".strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def packed_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """The sweep's rows with several documents each (``PACKED_DOCUMENTS``: one boundary inside a shard, one document
    across the shard boundary), as a packing collator gives them: ``position_ids`` restarting at each document,
    ``labels`` -100 at each document's first token (no prediction across a boundary)."""
    out = []
    for step, batch in enumerate(batches(steps)):
        lengths = PACKED_DOCUMENTS[step % len(PACKED_DOCUMENTS)]
        assert sum(lengths) == batch["input_ids"].shape[1], lengths
        starts = torch.tensor(lengths).cumsum(0)[:-1]
        labels = batch["labels"].clone()
        labels[0, starts] = -100
        out.append({"input_ids": batch["input_ids"], "labels": labels,
                    "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]})
    return out


def rows_of(setting: str, steps: int) -> list[dict[str, torch.Tensor]]:
    return packed_batches(steps) if setting in (PACKED, BF16_PACKED) else batches(steps)


def packing_support(model: torch.nn.Module, model_type: str) -> Optional[str]:
    """Why transformers' own forward of ``model`` does not train packed rows (``None``: it does): it must take
    ``position_ids`` and give each document of a packed row the logits of that document alone."""
    import inspect

    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids"
    batch = packed_batches(1)[0]
    lengths = PACKED_DOCUMENTS[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           **forward_kwargs(model_type)).logits[0]
            alone = torch.cat([model(input_ids=document, position_ids=torch.arange(document.shape[1])[None],
                                     **forward_kwargs(model_type)).logits[0]
                               for document in batch["input_ids"].split(lengths, dim=1)])
    finally:
        model.train(was_training)
    difference = ((packed - alone).abs().max() / alone.abs().max()).item()
    if not difference <= 1e-4:
        return (f"transformers' own forward lets packed documents see each other (a packed row's logits differ from "
                f"its documents' alone by {difference:.1e})")
    return None


def train_reference(model_type: str, class_name: Optional[str] = None, steps: int = STEPS,
                    setting: str = ZERO2) -> dict[str, Any]:
    """One process, plain transformers, SGD on the sweep's batches (packed ones for ``PACKED``); raises if the model
    does not build or its plain forward / backward fails or gives a non-finite loss. ``BF16``: the float64 run and
    the bf16 one on one device (``{"exact": ..., "one": ...}``, see :func:`train_in_dtypes`)."""
    if setting in (BF16, BF16_PACKED):
        return train_in_dtypes(model_type, class_name, steps, setting)
    model = build(model_type, class_name)
    if setting == PACKED:
        unsupported = packing_support(model, model_type)
        if unsupported:
            raise NotApplicable(unsupported)
    model.train()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr_for(model_type))
    losses = []
    for batch in rows_of(setting, steps):
        loss = model(**batch, **forward_kwargs(model_type)).loss
        if loss is None or not torch.isfinite(loss):
            raise ValueError(f"plain forward gave loss {loss}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "initial": initial,
            "final": {k: v.detach().clone() for k, v in model.named_parameters()},
            "parameters": sum(v.numel() for v in initial.values())}


# The one-device bf16 runs whose largest error is bf16's own (:func:`train_in_dtypes`): the same training computed
# by the attention kernels one device may run, and with its row repeated 3 times in the batch (the same mean loss and
# gradient, other matmul shapes). A single run's loss error is one sample of bf16's rounding noise, and equally valid
# computations differ by several times at the 1e-5 level (measured: granite_swa's first loss 6.9e-6 off float64 with
# gradients on, 4.0e-5 without: SDPA picks another CPU kernel; gpt_oss's third loss 2.4e-5 off, 9.6e-5 with the row
# repeated 3 times).
BF16_VARIANTS = ("sdpa default kernel", "sdpa math kernel", "eager attention", "row repeated 3 times")


def _variant(name: str, model: torch.nn.Module):
    """A context in which ``model`` computes as the one-device variant ``name``."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "sdpa math kernel":
        return sdpa_kernel(SDPBackend.MATH)
    if name == "eager attention":
        model.set_attn_implementation("eager")
    return contextlib.nullcontext()


def train_in_dtypes(model_type: str, class_name: Optional[str] = None, steps: int = STEPS,
                    setting: str = BF16) -> dict[str, Any]:
    """The bf16 columns' references, one device each: the training in float64 (``exact``) and in bf16 with float32
    master weights (``one``, as DeepSpeed's bf16 mode keeps them), the latter once per :data:`BF16_VARIANTS`
    (``variants``: name -> run; a variant the model cannot run is left out). Raises :class:`NotApplicable` where the
    model does not run in float64 or in bf16 on CPU."""
    from tests.support.precision import sgd_in_dtype

    rows = rows_of(setting, steps)

    def loss_of_step(model, step, repeats=1):
        loss = model(**{k: v.repeat(repeats, 1) for k, v in rows[step].items()}, **forward_kwargs(model_type)).loss
        if loss is None or not torch.isfinite(loss):
            raise ValueError(f"plain forward gave loss {loss}")
        return loss

    out: dict[str, Any] = {"variants": {}}
    for key, dtype in [("exact", torch.float64)] + [(name, torch.bfloat16) for name in BF16_VARIANTS]:
        model = build(model_type, class_name)
        if setting == BF16_PACKED and key == "exact":
            unsupported = packing_support(model, model_type)
            if unsupported:
                raise NotApplicable(unsupported)
        model.train()
        if dtype == torch.float64 and getattr(model, "_can_set_experts_implementation", lambda: False)():
            model.set_experts_implementation("eager")  # torch's grouped matmul has no float64 kernel on CPU
        try:
            repeats = 3 if key == "row repeated 3 times" else 1
            with _variant(key, model):
                run = sgd_in_dtype(model, lambda m: dict(m.named_parameters()),
                                   functools.partial(loss_of_step, repeats=repeats), lr_for(model_type), dtype,
                                   steps=steps, buffers_too=False)  # as DeepSpeed casts it (bf16-mixed)
        except Exception as err:  # noqa: BLE001 - the column says why (or the variant is left out)
            if key in ("exact", BF16_VARIANTS[0]):
                what = "float64" if key == "exact" else "bf16 parameters (float32 buffers, as DeepSpeed casts it)"
                raise NotApplicable(f"does not train in {what} on one device: {first_line(err, 150)}")
            continue
        if key == "exact":
            out["exact"] = run
        else:
            out["variants"][key] = run
    out["one"] = out["variants"][BF16_VARIANTS[0]]
    return out


def compare(reference: dict, losses: list[float], final: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Max relative per-step loss difference, and the worst parameter's relative update difference (as
    ``tests/test_architectures.py``: one ulp of the final weight counts as none, a zero update compares
    absolutely; a difference within one float rounding of the whole weight tensor counts as none)."""
    got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(reference["losses"], dtype=torch.float64)
    if got.shape != want.shape:
        return {"loss_diff": float("inf"), "update_diff": float("inf"), "worst_param": "steps differ"}
    loss_diff = ((got - want).abs() / want.abs()).max().item()
    worst, worst_name = 0.0, None
    for param, initial in reference["initial"].items():
        if param not in final:
            return {"loss_diff": loss_diff, "update_diff": float("inf"), "worst_param": f"{param} missing"}
        expected = reference["final"][param] - initial
        actual = final[param].to(initial.dtype) - initial
        scale = expected.norm().item()
        ref_final = reference["final"][param]
        ulp = (torch.nextafter(ref_final, torch.full_like(ref_final, float("inf"))) - ref_final).abs()
        diff = ((actual - expected).abs() - ulp).clamp_min(0).norm().item()
        if diff <= torch.finfo(ref_final.dtype).eps * ref_final.norm().item():
            # within one rounding of the weight tensor: no difference (an update that is zero in exact arithmetic,
            # an MoE router's at top-1, is fp32 noise of 1e-10 that an absolute scale of 1e-6 counted as 1e-4)
            diff = 0.0
        rel = diff / scale if scale > 1e-6 else diff / 1e-6
        if not rel <= worst:  # NaN counts as worst
            worst, worst_name = rel, param
            if rel != rel:
                break
    return {"loss_diff": loss_diff, "update_diff": worst, "worst_param": worst_name}


def classify(model_type: str, reference: dict, ranks: list[dict], setting: str = ZERO2) -> dict[str, Any]:
    """The outcome of one SP fit (``ranks``: what each rank of ``tests/scenarios/causal_lm_sweep.py`` returned)."""
    errors = [r.get("error") for r in ranks if r.get("error")]
    if errors:
        error = errors[0]
        refused = all(r.get("error") and r.get("raised_by_strategy") and not r.get("losses") for r in ranks)
        where = next((r.get("raised_in") for r in ranks if r.get("error")), None)
        trace = next((r.get("trace") for r in ranks if r.get("error")), None)
        return {"outcome": REFUSED if refused else CRASHED, "reason": error, "raised_in": where, "trace": trace}
    if setting in (BF16, BF16_PACKED):
        return _classify_bf16(reference, ranks)
    row: dict[str, Any] = compare(reference, ranks[0]["losses"], ranks[0]["final"])
    row["losses"], row["plain_losses"] = ranks[0]["losses"], reference["losses"]
    row["ranks_agree"] = all(r["losses"] == ranks[0]["losses"] for r in ranks)
    row["update_tol"] = update_tol_for(model_type)
    ok = row["loss_diff"] <= LOSS_TOL and row["update_diff"] <= row["update_tol"] and row["ranks_agree"]
    row["outcome"] = EXACT if ok else WRONG
    return row


def _classify_bf16(reference: dict, ranks: list[dict]) -> dict[str, Any]:
    """bf16's criterion: against the float64 run, SP's per-step loss error and its update error at most
    ``BF16_RATIO`` times bf16's own (the largest of the one-device bf16 runs, :data:`BF16_VARIANTS`), and the SP
    run's weights really bf16."""
    from tests.support.precision import loss_error, update_error

    exact, variants = reference["exact"], reference["variants"]
    initial = reference["one"]["initial"]
    sp = ranks[0]
    row: dict[str, Any] = {
        "loss_error": loss_error(sp["losses"], exact["losses"]),
        "one_loss_error": max(loss_error(v["losses"], exact["losses"]) for v in variants.values()),
        "update_error": update_error(sp["final"], initial, exact),
        "one_update_error": max(update_error(v["weights"], initial, exact) for v in variants.values()),
        "one_device_variants": {name: {"loss_error": loss_error(v["losses"], exact["losses"]),
                                       "update_error": update_error(v["weights"], initial, exact)}
                                for name, v in variants.items()},
        "parameter_dtypes": sp.get("parameter_dtypes"), "losses": sp["losses"], "plain_losses": exact["losses"],
        "ranks_agree": all(r["losses"] == sp["losses"] for r in ranks)}
    row["loss_ratio"] = row["loss_error"] / max(row["one_loss_error"], 1e-12)
    row["update_ratio"] = row["update_error"] / max(row["one_update_error"], 1e-12)
    ok = (row["loss_error"] <= BF16_RATIO * row["one_loss_error"] + 1e-6
          and row["update_error"] <= BF16_RATIO * row["one_update_error"] and row["ranks_agree"]
          and row["parameter_dtypes"] == ["torch.bfloat16"])
    row["outcome"] = EXACT if ok else WRONG
    return row


class NotApplicable(Exception):
    """A setting the model does not have without SP either (packed rows its own forward mixes, a dtype it does not
    run in on CPU): the column says why, nothing is compared."""


def recorded() -> dict[str, dict]:
    """The committed sweep results, by model_type."""
    return json.loads(RESULTS.read_text())["models"]


def format_exception(err: BaseException) -> dict[str, Any]:
    """``error`` (first line) and whether the innermost frame that raised it is the strategy's own code."""
    frames = traceback.extract_tb(err.__traceback__)
    origin = frames[-1].filename if frames else ""
    # a refusal: the strategy's code raised one of its own errors, or a ValueError / NotImplementedError (not, e.g.,
    # a RuntimeError of a reshape inside it)
    deliberate = type(err).__module__.startswith("lightning_ulysses") or isinstance(err, (ValueError,
                                                                                         NotImplementedError))
    return {"error": first_line(err, 300), "message": str(err)[:3000], "raised_by_strategy": "lightning_ulysses" in origin and deliberate,
            "raised_in": f"{_short(origin)}:{frames[-1].lineno}" if frames else "",
            "trace": [f"{_short(f.filename)}:{f.lineno} {f.name}: {f.line}" for f in frames[-6:]],
            "cause_trace": [f"{_short(f.filename)}:{f.lineno} {f.name}: {f.line}"
                            for f in traceback.extract_tb(err.__cause__.__traceback__)[-8:]] if err.__cause__ else []}


def _short(path: str) -> str:
    """A source path from its package (``transformers/models/...``) or from the repository root."""
    for marker in ("site-packages/", f"{REPO_ROOT}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path

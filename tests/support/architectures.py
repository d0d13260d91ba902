"""Tiny configurations of many Hugging Face causal-LM architectures, with what the strategy must do with each.

Every entry: hidden 64, 2 layers, 4 heads (2 KV heads where the model has them), vocabulary 128, no dropout, built
with ``attn_implementation="sdpa"`` unless it says otherwise. Sliding windows are 8 tokens, shorter than the
32-token test sequences, and models that mix window and full layers get one of each. ``expect`` is ``"exact"``
(SP=2 matches a plain process) or the phrase the refusal must contain.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ_LEN, WINDOW = 128, 32, 8
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=VOCAB, max_position_embeddings=256, head_dim=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
MIXED = ["sliding_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
LINEAR = ["linear_attention", "full_attention"]  # one mixer layer, one attention layer
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=32)
FALCON_H1_MUP = dict(ssm_multipliers=[0.5, 2.0, 0.7, 1.3, 0.9], ssm_in_multiplier=1.5)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # plain full attention
    "llama": {"type": "llama"},
    "qwen3": {"type": "qwen3"},
    "gemma": {"type": "gemma"},
    "phi": {"type": "phi"},
    "phi3": {"type": "phi3"},
    "gpt2": {"type": "gpt2"},
    "gpt_neox": {"type": "gpt_neox"},
    "gpt_bigcode": {"type": "gpt_bigcode", "config": {"multi_query": True}},
    "olmo2": {"type": "olmo2"},
    "cohere": {"type": "cohere"},
    "granite": {"type": "granite"},
    "glm": {"type": "glm"},
    "stablelm": {"type": "stablelm"},
    "persimmon": {"type": "persimmon"},
    "nemotron": {"type": "nemotron"},
    "opt": {"type": "opt", "config": {"ffn_dim": 128, "word_embed_proj_dim": 64}},
    "smollm3": {"type": "smollm3"},  # NoPE layers
    "ernie4_5": {"type": "ernie4_5"},
    "helium": {"type": "helium"},
    "biogpt": {"type": "biogpt"},
    "deepseek_v3": {"type": "deepseek_v3", "config": dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                          qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                                          first_k_dense_replace=1, n_group=1, topk_group=1,
                                                          head_dim=8)},
    # DeepSeek V3's real ratio of head sizes (query/key 192 = 128 + 64, value 128): value heads of another size
    "deepseek_v3_mla_heads": {"type": "deepseek_v3", "config": dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_key_value_heads=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        head_dim=8)},
    # an attention class not named "...Attention" (as LongcatFlashMLA, or remote code's MLA classes): recognised by
    # what its forward does (it dispatches through transformers' attention interface), not by its name
    "llama_attention_renamed": {"type": "llama", "rename_attention": "LatentMixer"},
    # ... with ring attention, which passes blocks of one head size: refused before compute naming both sizes
    "deepseek_v3_mla_heads_ring": {"type": "deepseek_v3", "config": dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_key_value_heads=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        head_dim=8), "strategy": {"ring_size": 2},
        "expect": "value heads of 16 dims and query/key heads of 24"},
    # attention that calls torch's SDPA itself (the exchange goes around those calls)
    "falcon": {"type": "falcon", "config": {"head_dim": None}},  # multi-query: 1 KV head
    "falcon_new_arch": {"type": "falcon", "config": {"head_dim": None, "new_decoder_architecture": True,
                                                     "num_kv_heads": 2}},
    # mixture of experts without the auxiliary loss
    "qwen3_moe": {"type": "qwen3_moe", "config": MOE},
    "mixtral": {"type": "mixtral", "config": {"num_local_experts": 4, "num_experts_per_tok": 2}},
    "olmoe": {"type": "olmoe", "config": {"num_experts": 4, "num_experts_per_tok": 2}},
    # sliding windows shorter than the sequence
    "mistral_window": {"type": "mistral", "config": {"sliding_window": WINDOW}},
    "qwen2_window": {"type": "qwen2", "config": {"use_sliding_window": True, "sliding_window": WINDOW,
                                                 "max_window_layers": 1}},
    "starcoder2_window": {"type": "starcoder2", "config": {"sliding_window": WINDOW}},
    "gemma3_window": {"type": "gemma3_text", "config": {"sliding_window": WINDOW, "layer_types": MIXED}},
    "cohere2_window": {"type": "cohere2", "config": {"sliding_window": WINDOW, "layer_types": MIXED}},
    "exaone4_window": {"type": "exaone4", "config": {"sliding_window": WINDOW, "layer_types": MIXED}},
    "ministral_window": {"type": "ministral", "config": {"sliding_window": WINDOW, "layer_types": MIXED}},
    "olmo3_window": {"type": "olmo3", "config": {"sliding_window": WINDOW, "layer_types": MIXED}},
    # the MoE router's load-balancing loss over the whole global batch (coefficient 0.5 so that it matters)
    "qwen3_moe_aux_loss": {"type": "qwen3_moe", "config": {**MOE, **AUX}},
    "qwen3_moe_aux_loss_in_forward": {"type": "qwen3_moe", "config": {**MOE, "router_aux_loss_coef": 0.5},
                                      "forward": {"output_router_logits": True}},
    "qwen2_moe_aux_loss": {"type": "qwen2_moe", "config": {**MOE, **AUX, "shared_expert_intermediate_size": 32}},
    "mixtral_aux_loss": {"type": "mixtral", "config": {"num_local_experts": 4, "num_experts_per_tok": 2, **AUX}},
    "olmoe_aux_loss": {"type": "olmoe", "config": {"num_experts": 4, "num_experts_per_tok": 2, **AUX}},
    # sequence mixers other than attention (run on the whole sequence, lightning_ulysses.models.mixers)
    "qwen3_next": {"type": "qwen3_next", "config": {**MOE, "layer_types": ["linear_attention", "full_attention"],
                                                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                                    "linear_key_head_dim": 16, "linear_value_head_dim": 16}},
    "lfm2": {"type": "lfm2", "config": {"layer_types": ["conv", "full_attention"]}},
    "minimax": {"type": "minimax", "config": {"layer_types": ["linear_attention", "full_attention"],
                                              "num_local_experts": 4, "num_experts_per_tok": 2}},
    # gated delta nets
    "qwen3_5_text": {"type": "qwen3_5_text", "config": {**GDN, "layer_types": LINEAR}},
    "qwen3_5_moe_text": {"type": "qwen3_5_moe_text", "config": {**GDN, **MOE, "layer_types": LINEAR,
                                                                "shared_expert_intermediate_size": 32}},
    "olmo_hybrid": {"type": "olmo_hybrid", "config": {**GDN, "layer_types": LINEAR}},
    "qwen4_exp_text": {"type": "qwen4_exp_text", "config": {
        **GDN, **MOE, "layer_types": ["linear_attention", "indexed_attention"], "shared_expert_intermediate_size": 32,
        "hc_count": 4, "hc_lowrank": 16, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 32, "indexer_compress_ratio": 8}, "expect": "indexed attention"},
    "kimi_linear": {"type": "kimi_linear", "config": {
        "layer_types": LINEAR, "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 4, "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1}},
    # Mamba2 mixers (one head group: n_groups 1, as the Bamba / Granite 4 / Falcon-H1 checkpoints)
    "nemotron_h": {"type": "nemotron_h", "config": {
        "layers_block_type": LINEAR, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
        "conv_kernel": 4, "expand": 2, "chunk_size": 32, "use_mamba_kernels": False, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}},
    "bamba": {"type": "bamba", "config": {"attn_layer_indices": [1], **MAMBA2}},
    "granitemoehybrid": {"type": "granitemoehybrid", "config": {
        "intermediate_size": 32, "shared_intermediate_size": 128, "layer_types": LINEAR, "num_local_experts": 4,
        "num_experts_per_tok": 2, **MAMBA2, **AUX}},
    # attention ‖ Mamba in a layer; µP multipliers on the projected features, a gated norm (gate first)
    "falcon_h1": {"type": "falcon_h1", "config": {"mamba_d_ssm": 128, **MAMBA2, **FALCON_H1_MUP,
                                                  "mamba_rms_norm": True, "mamba_norm_before_gate": False}},
    "falcon_h1_no_norm": {"type": "falcon_h1", "config": {"mamba_d_ssm": 128, **MAMBA2}},  # the config's defaults
    "zamba2": {"type": "zamba2", "config": {  # a shared attention block next to the Mamba layers
        "layers_block_type": ["linear_attention", "hybrid"], "n_mamba_heads": 8, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "chunk_size": 32, "use_mamba_kernels": False,
        "head_dim": None}},
    "mamba2": {"type": "mamba2", "config": {"num_heads": 8, "expand": 2, "n_groups": 1, "state_size": 16,
                                            "conv_kernel": 4, "chunk_size": 32}, "attn": None},
    # short convolutions
    "lfm2_moe": {"type": "lfm2_moe", "config": {**MOE, **AUX, "layer_types": ["conv", "full_attention"],
                                                "num_dense_layers": 1, "conv_L_cache": 4}},
    # lr 0.1: at 0.5 this tiny model diverges and amplifies rounding (one device fp32 vs fp64 already 7e-5 on
    # in_proj; a head-parallel run 2.8e-4); at 0.1 the head-parallel update is within 2e-6.
    "lfm3": {"type": "lfm3", "config": {"layer_types": ["conv", "full_attention"], "sliding_window": 32,
                                        "conv_L_cache": 4}, "lr": 0.1},
    # Mamba1 (its x_proj contracts over all channels: no head split, but the whole-sequence run is exact)
    "jamba": {"type": "jamba", "config": {
        "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "use_mamba_kernels": False}},
    "mamba": {"type": "mamba", "config": {"state_size": 16, "expand": 2, "conv_kernel": 4}, "attn": None},
    "falcon_mamba": {"type": "falcon_mamba", "config": {"state_size": 16, "expand": 2, "conv_kernel": 4},
                     "attn": None},
    # mixer heads that sp=2 does not divide: the first rank takes one more
    "qwen3_5_text_3_heads": {"type": "qwen3_5_text", "config": {**GDN, "layer_types": LINEAR,
                                                                "linear_num_key_heads": 3, "linear_num_value_heads": 6}},
    "kimi_linear_3_heads": {"type": "kimi_linear", "config": {
        "layer_types": LINEAR, "mlp_layer_types": ["dense", "dense"], "linear_num_heads": 3, "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16}},
    "falcon_h1_3_heads": {"type": "falcon_h1", "config": {**MAMBA2, **FALCON_H1_MUP, "mamba_n_heads": 3,
                                                          "mamba_d_ssm": 48, "mamba_rms_norm": True,
                                                          "mamba_norm_before_gate": True}},
    "minimax_3_heads": {"type": "minimax", "config": {"layer_types": ["linear_attention", "full_attention"],
                                                      "num_attention_heads": 3, "num_key_value_heads": 3,
                                                      "head_dim": 16, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}},
    # Llama 4: chunked local attention (chunks of 8 positions of the whole row) and NoPE layers whose query temperature
    # follows the position (floor_scale 4: every 32-token row crosses it several times)
    "llama4_text": {"type": "llama4_text", "config": {
        "floor_scale": 4, "attn_temperature_tuning": True, "no_rope_layers": [1, 0], "attention_chunk_size": 8,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 128}},
    # GPT-OSS: per-head attention sinks (`s_aux`), sliding and full layers, MoE with its router; built eager (its
    # only implementation on CPU), run by the strategy's sink kernel
    "gpt_oss": {"type": "gpt_oss", "attn": "eager", "config": {
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2}},
    # Gemma 4's structure (head_dim 16): per-layer inputs, sliding and full layers, the last two layers sharing the KV
    # of earlier ones. Its fp32 rounding is amplified ~10x (query scaling 1.0): on ONE device sdpa and eager differ
    # by 3.5e-4 in the 3-step update (Llama: 3.3e-5), so its update bound is 2e-3 (measured under SP: 5.4e-4).
    "gemma4_text": {"type": "gemma4_text", "update_tol": 2e-3, "config": {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8,
        "global_head_dim": 16, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128,
        "num_kv_shared_layers": 2}},
    # RoBERTa-style embeddings number positions from padding_idx + 1 when given none (XLM-R, CamemBERT, ...)
    "roberta": {"type": "roberta", "config": {"is_decoder": True}},
    # DBRX: fused experts that read another module's parameters (ZeRO-3 gathers them only inside a forward pass)
    "dbrx": {"type": "dbrx", "config": {
        "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}},
    # attention output `.view`ed by the model (the Ulysses attention returns it contiguous, as transformers does)
    "jetmoe": {"type": "jetmoe", "config": {"kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2}},
    "afmoe": {"type": "afmoe"},
    # refused before compute
    "doge": {"type": "doge", "expect": "attention_mask"},
    "gemma2_eager": {"type": "gemma2", "attn": "eager", "expect": "supports only ['flash_attention_2',"
                                                                  " 'flash_attention_3', 'flex_attention'], which run"
                                                                  " on CUDA"},
    # built eager: refused, naming what GPT-J supports (transformers 5.24 added sdpa and flex to its flash kernels)
    "gptj_eager": {"type": "gptj", "attn": "eager", "expect": "'flash_attention_2', 'flash_attention_3'"},
    "falcon_alibi": {"type": "falcon", "config": {"head_dim": None, "alibi": True}, "expect": "ALiBi"},
    "deepseek_v32_sparse": {"type": "deepseek_v32", "config": dict(
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=8,
        index_topk=8, index_head_dim=16, index_n_heads=2), "expect": "an indexer (`DeepseekV32Indexer`)"},
    "zaya": {"type": "zaya", "expect": "compressed convolutional attention (CCA)"},
    "recurrent_gemma": {"type": "recurrent_gemma", "config": {
        "num_hidden_layers": 3, "num_key_value_heads": 1, "lru_width": 64, "attention_window_size": 8,
        "intermediate_size": 96}, "expect": "RG-LRU recurrence (`RecurrentGemmaRecurrentBlock`"},
    # recurrences (no attention through the interface, no mixer the exchange takes): named as such, whatever the
    # implementation; GPT-Neo (eager or flash only) on CPU: named as CUDA-only
    "rwkv": {"type": "rwkv", "config": {"attention_hidden_size": 64, "context_length": 64}, "attn": "eager",
             "expect": "mixes the sequence without attention"},
    "xlstm": {"type": "xlstm", "config": {"num_heads": 4}, "attn": "eager", "expect": "RWKV's time mixing or xLSTM"},
    "gpt_neo_eager": {"type": "gpt_neo", "config": {"num_layers": 2, "num_heads": 4, "window_size": 8,
                                                    "attention_types": [[["global", "local"], 1]]},
                      "attn": "eager", "expect": "which run on CUDA: on CPU it cannot train"},
}


def build_config(name: str):
    from transformers import AutoConfig

    entry = ARCHITECTURES[name]
    overrides = {**BASE, **entry.get("config", {})}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    config = AutoConfig.for_model(entry["type"], **overrides)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def build_model(name: str, seed: int = 0, dtype: str = "float32"):
    """``dtype`` ``"float64"``: the model in double precision (to tell an SP error from the model's own rounding)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = ARCHITECTURES[name].get("attn", "sdpa")  # None: pure state-space models take no attention implementation
    kwargs = {} if attn is None else {"attn_implementation": attn}
    if dtype == "float64":
        _keep_double_precision()
    model = AutoModelForCausalLM.from_config(build_config(name), **kwargs).to(getattr(torch, dtype))
    suffix = ARCHITECTURES[name].get("rename_attention")
    if suffix:
        for module in model.modules():
            if type(module).__name__.endswith("Attention"):
                module.__class__ = _renamed(type(module), suffix)
    return model


_RENAMED: dict[tuple[type, str], type] = {}


def _renamed(cls: type, suffix: str) -> type:
    """``cls`` under a name without "Attention" (``LlamaAttention`` -> ``LlamaLatentMixer``), same behaviour."""
    if (cls, suffix) not in _RENAMED:
        _RENAMED[(cls, suffix)] = type(cls.__name__.replace("Attention", suffix), (cls,), {"__module__": __name__})
    return _RENAMED[(cls, suffix)]


def _keep_double_precision() -> None:
    """transformers' causal-LM loss casts the logits to fp32 (``logits.float()``; the strategy's loss keeps float64
    float64): for a float64 model the reference's loss stays float64 too, so that neither run has an fp32 step."""
    from transformers.loss import loss_utils

    original = loss_utils.ForCausalLMLoss
    if getattr(original, "keeps_double", False):
        return

    def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                       **kwargs):
        if logits.dtype != torch.float64:
            return original(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return loss_utils.fixed_cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                              num_items_in_batch, ignore_index, **kwargs)

    causal_lm_loss.keeps_double = True
    loss_utils.ForCausalLMLoss = causal_lm_loss
    loss_utils.LOSS_MAPPING["ForCausalLM"] = causal_lm_loss


def batches(steps: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """``steps`` full batches [1, SEQ_LEN] (labels = input_ids)."""
    rows = torch.randint(3, VOCAB, (steps, 1, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def train_plain(name: str, steps: int, lr: float, dtype: str = "float32") -> dict[str, Any]:
    """The reference: one process, plain transformers, SGD on the same batches. ``dtype`` ``"float64"``: the model in
    float64 with fp32 master weights stepped by SGD, as DeepSpeed's ZeRO optimizer keeps them (its fp32 partition of
    every parameter, updated with the fp32 gradient, copied back to the float64 model): the two runs then differ only
    in the forward and backward passes, computed in float64."""
    model = build_model(name, dtype=dtype)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    masters = {k: v.detach().float().clone() for k, v in model.named_parameters()} if dtype == "float64" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches(steps):
        loss = model(**batch, **ARCHITECTURES[name].get("forward", {})).loss
        loss.backward()
        if masters is None:
            optimizer.step()
        else:
            with torch.no_grad():
                for key, param in model.named_parameters():
                    if param.grad is not None:
                        masters[key].add_(param.grad.float(), alpha=-lr)
                    param.copy_(masters[key])
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "initial": initial,
            "final": {k: v.detach().clone() for k, v in model.named_parameters()}}

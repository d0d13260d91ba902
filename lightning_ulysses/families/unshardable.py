"""Model types that cannot train under sequence parallelism for a reason their structure does not show before any
compute (learned mask biases, indexed attention, zero-compute experts, convolutions inside attention), each with the
reason the refusal names (:func:`lightning_ulysses.models.refusals.refuse_unsupported_architecture`). Found by the
sweep over every causal-LM type (``docs/causal-lm-sweep.md``)."""

from __future__ import annotations

# Architectures whose attention takes inputs the exchange cannot shard, known before any compute (the attention
# function also refuses a mask that requires grad at the first forward, for models not listed here).
KNOWN_UNSHARDABLE = {
    "recurrent_gemma": "mixes the sequence with its RG-LRU recurrence (`RecurrentGemmaRecurrentBlock`: a short"
                       " convolution, then `RecurrentGemmaRglru`, a gated linear recurrence over the positions), which"
                       " the mixer exchange does not take (its convolution alone would be split, the recurrence"
                       " would restart at every shard)",
    "deepseek_v32": "uses DeepSeek sparse attention: an indexer (`DeepseekV32Indexer`) picks each query's"
                    " `index_topk` keys from the whole sequence, by scores summed over all its heads, and the"
                    " attention masks the others through a full 4-D mask. Neither a split of the heads nor of the"
                    " sequence computes that top-k without exchanging [S, S] scores. (It is dense attention only"
                    " while index_topk, 2048 by default, covers the sequence: shorter than the sequences sequence"
                    " parallelism is for)",
    "doge": "passes a learned per-key bias (its dynamic mask) to attention through attention_mask",
    "longcat_flash": "routes tokens to zero-compute (identity) experts: on a rank whose shard routes no token to a"
                     " real expert of a layer, that layer's expert weights get no gradient there while another"
                     " rank's do, and DeepSpeed's ZeRO gradient buckets then differ between the ranks (measured:"
                     " 2331840 against 1258688 elements in one bucket, the processes abort; where the sizes happen"
                     " to match, slices of different parameters would be summed)",
    "zaya": "mixes the sequence inside its attention module, before the attention kernel: its compressed"
            " convolutional attention (CCA) convolves queries and keys over the positions (`conv_qk_depthwise`,"
            " `cca_time0/1`) and mixes in the previous token's value; the Ulysses exchange would cut those"
            " convolutions at every shard boundary",
    "blt": "attends between two sequences of different lengths (bytes and patches: the cross-attention of its local"
           " encoder and decoder, `BltCrossAttention`), which the Ulysses exchange, built for one sequence cut into"
           " equal shards, cannot shard",
    "qwen4_exp_text": "uses indexed attention (each query attends to the keys an indexer selects from the whole"
                      " sequence, through a full 4-D mask; its n-gram embeddings also read the tokens before a shard)",
}

"""TensorMemoryTracker counts what a step allocates, tensor by tensor (in process), and what a rank keeps per token
of its shard at sp 1, 2 and 4 (launched): nothing beyond its share of the sequence but the one copy named below."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses import TensorMemoryTracker
from lightning_ulysses.profiling.tensor_memory import layer_of, name_modules
from tests.support.launcher import launch

FLOAT = 4  # bytes


def test_counts_allocations_not_views_nor_in_place_results():
    x = torch.randn(1000, 100)
    w = torch.randn(100, 50, requires_grad=True)
    with TensorMemoryTracker() as tracker:
        y = x @ w  # 1000 x 50 floats: allocated (mm saves x, made outside, for w's gradient)
        y.t()  # a view: nothing
        y.detach().add_(1.0)  # in place: nothing
        z = torch.relu(y)  # allocated, saved for relu's backward
        del y  # nothing saved it: freed
    step = tracker.result()
    assert step.peak_bytes == 2 * 1000 * 50 * FLOAT
    assert step.end_bytes == 1000 * 50 * FLOAT
    assert step.by_kind["saved for backward"] == 1000 * 50 * FLOAT  # relu's result, kept for its backward
    del z


def test_freed_storages_leave_the_count_and_the_peak_stays():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(1 << 20)  # 4 MiB
        del a
        b = torch.empty(1 << 18)  # 1 MiB, after a was freed
    step = tracker.result()
    assert step.peak_bytes == (1 << 20) * FLOAT
    assert step.end_bytes == (1 << 18) * FLOAT
    del b


def test_each_span_counts_only_what_it_made():
    tracker = TensorMemoryTracker()
    with tracker:
        kept = torch.empty(1 << 18)
    with tracker:
        torch.empty(1 << 10)
    assert [s.peak_bytes for s in tracker.spans] == [(1 << 18) * FLOAT, (1 << 10) * FLOAT]
    del kept


def test_layers_and_kinds_are_named_by_module_paths():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    name_modules(model)
    with TensorMemoryTracker() as tracker:
        out = model(torch.tensor([[1, 2, 3]]))
        mask = out > 0
    step = tracker.result()
    assert step.by_module["0"] == 3 * 8 * FLOAT and step.by_module["1"] == 3 * 8 * FLOAT
    assert step.by_kind["masks"] == 3 * 8  # one byte per bool
    assert layer_of("model.model.layers.12.mlp.up_proj") == "layer 12"
    assert layer_of("transformer.h.3.attn") == "layer 3"
    assert layer_of("model.embed_tokens") == "embedding" and layer_of("") == "outside the model"
    del out, mask


# ------------------------------------------------------------------------------------------------ per rank, launched
# The issue model's shape (issue 50), shortened to keep the suite fast: a Llama with hidden 256 and 8 heads, vocabulary
# 512, 2 layers, SGD, ZeRO 2, S = 4096. Buckets of 1M elements (DeepSpeed allocates 2 per step whatever the model's
# size; Lightning's default of 2e8 is 1.5 GiB per rank at every sp, which would hide what this test looks for).
PAYLOAD = {"seq_len": 4096, "hidden": 256, "layers": 2, "vocab": 512, "steps": 2, "stage": 2, "bucket": 1_000_000}


# ZeRO 3 with bf16, whole parameters only under the persistence threshold (2 layers, S = 2048, sp = 2): in the sp=2
# launch
ZERO3_BF16 = {**PAYLOAD, "seq_len": 2048, "stage": 3, "precision": "bf16-mixed", "sp": 2}
# A mixture of experts (Qwen3-MoE, transformers' fused experts: 8 of a quarter width, 2 per token), S = 2048, at sp 1
# (in the sp=1 launch) and sp 2 (in the sp=2 launch)
MOE = {**PAYLOAD, "seq_len": 2048, "moe": True}
# A hybrid (Qwen3-Next: gated delta net and attention layers 3 : 1, fused experts), S = 2048, at sp 1 and 2
HYBRID = {**PAYLOAD, "seq_len": 2048, "hybrid": True}


# Hybrid Ulysses x ring with GQA (8 query heads, 2 KV heads), S = 2048: ring 2 alone at sp 2, 2 x 2 at sp 4; and ZeRO 3
# with every parameter partitioned (stage3_param_persistence_threshold=0) at sp 4, S = 8192 (at S = 2048, 512 tokens per
# rank, this toy's step is 6 MiB, 13%, over the plan: gradients ZeRO 3 holds before their bucket is reduced, which
# the plan does not count; at 2K tokens per rank and more, the grid's rows are within 1%)
RING = {**PAYLOAD, "seq_len": 2048, "kv_heads": 2, "ring": 2}
# Parameters outweighing activations (99 M: hidden 1024, 2 layers, vocabulary 32000; S = 512; buckets of 2e7): ZeRO 2's
# optimizer step is the peak; bf16 at sp 1 (in the sp=1 launch), float32 at sp 2 (the sp=2 launch)
OPTIMIZER_STEP = {**PAYLOAD, "seq_len": 512, "hidden": 1024, "vocab": 32000, "bucket": 20_000_000}
ZERO3_PARTITIONED = {**PAYLOAD, "seq_len": 8192, "stage": 3, "persistence": 0, "sp": 4}


@pytest.fixture(scope="module")
def launched():
    extra = {1: [{**MOE, "sp": 1}, {**HYBRID, "sp": 1}, {**OPTIMIZER_STEP, "sp": 1, "precision": "bf16-mixed"}],
             2: [ZERO3_BF16, {**MOE, "sp": 2}, {**HYBRID, "sp": 2}, {**RING, "sp": 2}, {**OPTIMIZER_STEP, "sp": 2}],
             4: [{**RING, "sp": 4}, ZERO3_PARTITIONED]}
    found = {sp: launch(sp, "memory_per_rank:run", {"runs": [{**PAYLOAD, "sp": sp}] + extra[sp]}) for sp in (1, 2, 4)}
    return {"per_sp": {sp: [r["runs"][0] for r in ranks] for sp, ranks in found.items()},
            "zero3_bf16": [r["runs"][1] for r in found[2]],
            "moe": {1: [r["runs"][1] for r in found[1]], 2: [r["runs"][2] for r in found[2]]},
            "hybrid": {1: [r["runs"][2] for r in found[1]], 2: [r["runs"][3] for r in found[2]]},
            "ring": {2: [r["runs"][4] for r in found[2]], 4: [r["runs"][1] for r in found[4]]},
            "zero3_partitioned": [r["runs"][2] for r in found[4]],
            "optimizer_step": {1: [r["runs"][3] for r in found[1]], 2: [r["runs"][5] for r in found[2]]}}


@pytest.fixture(scope="module")
def per_sp(launched):
    return launched["per_sp"]


@pytest.fixture(scope="module")
def zero3_bf16(launched):
    return launched["zero3_bf16"]


@pytest.mark.multiprocess
def test_peak_per_rank_falls_with_sp_and_losses_do_not_change(per_sp):
    peak = {sp: max(r["peak"] for r in ranks) for sp, ranks in per_sp.items()}
    assert peak[2] <= 0.55 * peak[1], peak
    assert peak[4] <= 0.30 * peak[1], peak
    for sp in (2, 4):
        for rank in per_sp[sp]:
            assert rank["losses"] == pytest.approx(per_sp[1][0]["losses"], rel=1e-5)


@pytest.mark.multiprocess
def test_no_layer_keeps_more_per_token_than_one_device_but_the_exchanged_attention_output(per_sp):
    """Per token of its shard, each decoder layer keeps what one device keeps per token, plus one copy of the attention
    output (hidden floats per token): on one device the attention kernel's output, which it saves, is also the output
    projection's input; under SP the projection's input is the output exchanged back to sequence shards, a second
    tensor. Anything else a rank kept per token (or anything growing with sp) shows here."""
    tokens = {sp: PAYLOAD["seq_len"] // sp for sp in (1, 2, 4)}
    one_copy = PAYLOAD["hidden"] * FLOAT
    for layer in ("layer 0",):  # the last layer's peak share depends on where backward stands
        per_token = {sp: per_sp[sp][0]["by_layer"][layer] / tokens[sp] for sp in (1, 2, 4)}
        assert per_token[2] == pytest.approx(per_token[1] + one_copy, rel=0.01), per_token
        assert per_token[4] == pytest.approx(per_token[2], rel=0.01), per_token


def _plan_config(payload):
    from transformers import LlamaConfig

    if payload.get("moe"):
        from tests.scenarios.memory_per_rank import moe_config

        return moe_config(payload)
    if payload.get("hybrid"):
        from tests.scenarios.memory_per_rank import hybrid_config

        return hybrid_config(payload)

    hidden = payload["hidden"]
    return LlamaConfig(vocab_size=payload["vocab"], hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=payload["layers"], num_attention_heads=8,
                       num_key_value_heads=payload.get("kv_heads", 8),
                       max_position_embeddings=payload["seq_len"], pad_token_id=0)


@pytest.fixture(scope="module")
def moe(launched):
    return launched["moe"]


@pytest.mark.multiprocess
def test_the_plan_predicts_what_each_rank_holds(per_sp, zero3_bf16, moe):
    """lightning_ulysses.plan, counted from shapes before any process starts, against the same runs: the step's
    allocations at their peak (with ZeRO 3's gathered parameters) within 2%, the states a step starts from
    (parameters, DeepSpeed's float32 copies and buffers, the batch) within 10%, the sum within 3%: at ZeRO 2 in
    float32 for sp 1, 2 and 4, at ZeRO 3 in bf16 for sp 2, and for a mixture of experts (Qwen3-MoE) at ZeRO 2 for sp 1
    and 2 (docs/planning.md)."""
    from lightning_ulysses.plan import plan_memory

    runs = [({**PAYLOAD, "sp": sp}, ranks) for sp, ranks in per_sp.items()] + [(ZERO3_BF16, zero3_bf16)] + [
        ({**MOE, "sp": sp}, ranks) for sp, ranks in moe.items()]
    for payload, ranks in runs:
        plan = plan_memory(_plan_config(payload), payload["seq_len"], sp_size=payload["sp"], stage=payload["stage"],
                           precision=payload.get("precision", "32-true"), optimizer="sgd",
                           reduce_bucket_size=payload["bucket"])
        step, states = max(r["peak"] for r in ranks), max(r["persistent"] for r in ranks)
        where = (payload["sp"], payload["stage"], plan.step, plan.zero3_gathered, step, plan.states, states)
        assert abs(plan.step + plan.zero3_gathered - step) <= 0.02 * step, where
        assert abs(plan.states.total - states) <= 0.10 * states, where
        assert abs(plan.peak - (step + states)) <= 0.03 * (step + states), where


@pytest.mark.multiprocess
def test_the_plan_of_zero2s_optimizer_step_is_within_two_percent(launched):
    """Where the parameters outweigh the activations ZeRO 2's optimizer step is the peak: the gradient partition, its
    flattened copy and in bf16 its float32 copy; the reduce buckets are released before it except in float32 across
    ranks (bf16 at one rank: the plan counted them, 10% over; the same +15% on an H100 and an H200)."""
    from lightning_ulysses.plan import plan_memory

    for sp, precision in ((1, "bf16-mixed"), (2, "32-true")):
        payload = {**OPTIMIZER_STEP, "sp": sp, "precision": precision}
        plan = plan_memory(_plan_config(payload), payload["seq_len"], sp_size=sp, stage=2, precision=precision,
                           optimizer="sgd", reduce_bucket_size=payload["bucket"])
        step = max(r["peak"] for r in launched["optimizer_step"][sp])
        assert "optimizer step (ZeRO gradient partitions, buckets)" in plan.step_by_kind, plan.step_by_kind
        assert abs(plan.step - step) <= 0.02 * step, (sp, precision, plan.step, step)


@pytest.mark.multiprocess
def test_the_plan_of_a_hybrid_is_within_five_percent(launched):
    """A Qwen3-Next (gated delta nets with transformers' torch fallback, attention, fused experts) at sp 1 and 2: the
    plan traces the mixer layers over the rank's shard with every head, where the run exchanges their channels to
    the whole sequence with 1/sp of the heads (the same elements; the exchange's buffers are not added): measured
    step -2.3% / -3.0%, peak -2.0% / -2.6%; pinned within 5% (docs/planning.md)."""
    from lightning_ulysses.plan import plan_memory

    for sp, ranks in launched["hybrid"].items():
        payload = {**HYBRID, "sp": sp}
        plan = plan_memory(_plan_config(payload), payload["seq_len"], sp_size=sp, stage=2, precision="32-true",
                           optimizer="sgd", reduce_bucket_size=payload["bucket"])
        step, states = max(r["peak"] for r in ranks), max(r["persistent"] for r in ranks)
        where = (sp, plan.step, step, plan.states.total, states)
        assert abs(plan.step - step) <= 0.05 * step, where
        assert abs(plan.states.total - states) <= 0.10 * states, where
        assert abs(plan.peak - (step + states)) <= 0.05 * (step + states), where
        assert ranks[0]["losses"] == pytest.approx(launched["hybrid"][1][0]["losses"], rel=1e-5)  # sp does not matter


def test_meta_tensors_are_counted_as_real_ones():
    """Shapes alone give the same count (``device="meta"``: no memory, no compute), so that memory can be planned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    peaks = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = LlamaForCausalLM(config)
        ids = torch.zeros(1, 64, dtype=torch.long, device=device)
        with TensorMemoryTracker() as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        peaks[device] = (tracker.result().peak_bytes, tracker.result().end_bytes)
    assert peaks["meta"] == peaks["cpu"] and peaks["cpu"][0] > 0, peaks


@pytest.mark.multiprocess
def test_the_plan_of_ring_attention_and_of_partitioned_zero3_is_within_two_percent(launched):
    """Ring attention traced with the strategy's own ring code (GQA, ring 2 at sp 2, 2 x 2 at sp 4) and ZeRO 3 with
    every parameter partitioned (a module's parameters and one prefetch bucket in flight): the peak within 2% (the
    grid of benchmarks/plan_accuracy.py: 0.0% and -0.1% to -0.9%)."""
    from lightning_ulysses.plan import plan_memory

    runs = [({**RING, "sp": sp}, ranks) for sp, ranks in launched["ring"].items()]
    runs.append((ZERO3_PARTITIONED, launched["zero3_partitioned"]))
    for payload, ranks in runs:
        plan = plan_memory(_plan_config(payload), payload["seq_len"], sp_size=payload["sp"],
                           ring_size=payload.get("ring", 1), stage=payload["stage"], precision="32-true",
                           optimizer="sgd", reduce_bucket_size=payload["bucket"],
                           persistence_threshold=payload.get("persistence", 100_000))
        measured = max(r["peak"] + r["persistent"] for r in ranks)
        assert abs(plan.peak - measured) <= 0.02 * measured, (payload, plan.peak, measured)
    for sp, ranks in launched["ring"].items():  # the ring does not change the training
        assert ranks[0]["losses"] == pytest.approx(launched["ring"][2][0]["losses"], rel=1e-5)


def test_only_the_loss_is_counted_as_logits_and_loss_under_the_memory_switches():
    """The memory switches wrap the model's forward (models/memory.py); what the model and the tiled MLP make there is
    not the loss: only the tiled loss's own functions and the LM head count as "logits and loss" (before, everything
    made under that module's forward did, and the plan's table put the layers' activations under the loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ulysses.models import memory

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    memory.enable(model, memory.MemoryFeatures(tiled_mlp=2, tiled_loss=2), None)
    name_modules(model)
    ids = torch.zeros(1, 64, dtype=torch.long)
    try:
        with TensorMemoryTracker() as tracker:
            loss = model(input_ids=ids, shift_labels=ids).loss  # the forward of layers and loss, under the switches
        forward = tracker.result()
    finally:
        memory.disable(model)
    one_chunk_of_logits = 32 * 128 * FLOAT  # the tiled loss in 2 chunks of 32 tokens
    assert forward.by_kind.get("logits and loss", 0) <= one_chunk_of_logits, forward.by_kind  # was all 504 KB
    assert forward.by_kind["saved for backward"] >= 2 * 64 * 64 * FLOAT, forward.by_kind  # the layers' inputs
    del loss

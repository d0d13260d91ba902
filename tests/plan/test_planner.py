"""The planner in process: its step count is the real step's, byte for byte, on a small model; its rules and its
command. Its accuracy against launched runs at sp 1/2/4 and ZeRO 2/3: tests/profiling/test_tensor_memory.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from lightning_ulysses import TensorMemoryTracker
from lightning_ulysses.plan import longest_sequence, plan_memory
from lightning_ulysses.plan.planner import zero3_gathered_elements
from lightning_ulysses.plan.__main__ import main
from lightning_ulysses.plan.activations import trace_step

CONFIG = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa")


def test_the_traced_step_is_the_real_steps_allocations():
    """One process, no strategy: the meta-device trace (attention as a flash kernel keeps it) against the real CPU
    step (sdpa's flash kernel for CPU), counted by the same tracker."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 512))
    with TensorMemoryTracker() as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    traced = trace_step(CONFIG, 512, batch_size=2)
    assert traced.peak == tracker.result().peak_bytes
    assert traced.parameters == sum(p.numel() for p in model.parameters())


def test_sequence_parallelism_divides_the_step_and_not_the_replicated_states():
    one = plan_memory(CONFIG, 8192, sp_size=1, world_size=4, stage=2, reduce_bucket_size=1_000_000)
    four = plan_memory(CONFIG, 8192, sp_size=4, world_size=4, stage=2, reduce_bucket_size=1_000_000)
    assert four.states == one.states  # ZeRO partitions over all 4 ranks in both
    assert four.step < 0.3 * one.step
    zero3 = plan_memory(CONFIG, 8192, sp_size=4, world_size=4, stage=3, reduce_bucket_size=1_000_000)
    assert zero3.states.master_and_gradients == 2 * four.states.master_and_gradients  # + the gradient partition
    # every parameter of this model is under ZeRO 3's persistence threshold but the embeddings and the MLPs
    assert four.states.parameters > zero3.states.parameters > four.states.parameters / 4


def test_bad_settings_are_refused_naming_the_rule():
    with pytest.raises(ValueError, match=r"8 attention heads do not split over 3 Ulysses ranks \(sp_size=3"):
        plan_memory(CONFIG, 4096, sp_size=3)
    with pytest.raises(ValueError, match="not a multiple of ring_size 3"):
        plan_memory(CONFIG, 4096, sp_size=4, ring_size=3)
    with pytest.raises(ValueError, match="2 KV heads: sp_size / ring_size = 3"):
        plan_memory(CONFIG.__class__(**{**CONFIG.to_dict(), "hidden_size": 192, "num_attention_heads": 6}), 4096, sp_size=6,
                    ring_size=2)
    with pytest.raises(ValueError, match="offload_parameters is ZeRO 3's offload_param"):
        plan_memory(CONFIG, 4096, stage=2, offload_parameters=True)
    with pytest.raises(ValueError, match="not a multiple of sp_size 4"):
        plan_memory(CONFIG, 4096, sp_size=4, world_size=6)
    with pytest.raises(ValueError, match="precision must be one of"):
        plan_memory(CONFIG, 4096, precision="fp8")


def test_the_longest_sequence_fits_and_the_next_does_not():
    settings = dict(sp_size=2, stage=2, reduce_bucket_size=1_000_000)
    budget = plan_memory(CONFIG, 40_000, **settings).peak
    longest = longest_sequence(CONFIG, budget, multiple=1024, **settings)
    assert plan_memory(CONFIG, longest, **settings).peak <= budget
    assert plan_memory(CONFIG, longest + 1024, **settings).peak > budget
    assert 38_000 <= longest <= 40_000
    assert longest_sequence(CONFIG, 1, **settings) == 0


def test_the_command_prints_the_plan_as_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(CONFIG.to_json_string())
    assert main(["--config", str(path), "--seq-len", "4096", "--sp", "1", "2", "3", "--memory-gib", "1",
                 "--longest", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["sp_size"] for p in plans] == [1, 2, 3]
    assert "do not split" in plans[2]["error"]
    assert plans[1]["peak"] < plans[0]["peak"] and plans[1]["fits"]
    assert plans[1]["longest_seq_len"] > plans[0]["longest_seq_len"] > 4096


def test_the_command_plots_the_peak_against_the_length(tmp_path, capsys):
    """``--plot``: a line per sp over seq-len/8 .. seq-len x 4, the budget drawn; the points are the plans."""
    pytest.importorskip("matplotlib")
    from lightning_ulysses.plan.plot import plot_lengths, plot_peaks

    path = tmp_path / "config.json"
    path.write_text(CONFIG.to_json_string())
    png = tmp_path / "peaks.png"
    assert main(["--config", str(path), "--seq-len", "4096", "--sp", "1", "2", "--memory-gib", "1",
                 "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lengths = plot_lengths(4096, [1, 2, 4])
    assert lengths[0] == 512 and lengths[-1] == 16384 and all(n % 8 == 0 for n in lengths)
    points = plot_peaks(lambda sp, n: plan_memory(CONFIG, n, sp_size=sp), lengths, [1, 2], 1 << 30,
                        str(tmp_path / "again.png"))
    assert [n for n, _ in points[1]] == lengths
    assert all(b < a for (_, a), (_, b) in zip(points[1], points[2]))  # sp=2 below sp=1 at every length


def test_the_preflight_check_stops_only_models_the_plan_was_measured_on():
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_ulysses.plan.preflight import not_validated

    def build(model_type, **sizes):
        config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **sizes)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    assert not_validated(build("llama")) is None
    assert not_validated(build("mixtral", num_local_experts=4)) is None  # fused experts: traced exactly
    assert "separate expert modules" in not_validated(build("llama", num_local_experts=4))  # no [E, ...] tensor
    assert not_validated(build("qwen3_next")) is None  # gated delta nets and fused experts: measured
    assert "BambaMixer" in not_validated(build("bamba"))  # a Mamba hybrid: not yet


def test_the_preflight_check_does_not_stop_offload_attention_on_cuda_until_measured_there():
    """offload_attention's plan matched launched CPU runs; on an H100 a checkpointed layer's backward went past it
    (docs/planning.md): on CUDA the check says it did not run rather than trust it; elsewhere it runs."""
    from lightning_ulysses.plan.preflight import not_validated_on

    assert "offload_attention on CUDA" in not_validated_on(torch.device("cuda", 0), True)
    assert not_validated_on(torch.device("cuda", 0), False) is None
    assert not_validated_on(torch.device("cpu"), 4096) is None


MOE_CONFIGS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      head_dim=16),
}


def _moe_config(name):
    from transformers import AutoConfig

    sizes = dict(MOE_CONFIGS[name])
    return AutoConfig.for_model(sizes.pop("model_type"), vocab_size=1024, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                attn_implementation="sdpa", **sizes)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_a_mixture_of_fused_experts_is_traced_as_the_real_step(name):
    """transformers' fused experts on the meta device (the grouped matmul's fallback, whose meta form allocates what
    the grouped matmul does) against the real CPU step: byte for byte, whatever experts the tokens pick."""
    from transformers import AutoModelForCausalLM

    config = _moe_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 512))
    with TensorMemoryTracker() as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    assert trace_step(config, 512, batch_size=2).peak == tracker.result().peak_bytes


def test_the_step_cost_of_a_mixture_counts_the_experts_a_token_picks():
    """6 FLOPs per weight a token multiplies with: of 4 Mixtral experts, the 2 it picks (as a dense MLP twice as
    wide) and the router."""
    from lightning_ulysses.plan.cost import matmul_parameters

    mixtral = _moe_config("mixtral")
    dense = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=2 * 256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2)
    assert matmul_parameters(mixtral) == matmul_parameters(dense) + 2 * 128 * 4


@pytest.mark.parametrize("tiled_mlp,tiled_loss", [(4, 0), (0, 4), (4, 4)])
def test_the_memory_switches_are_traced_with_the_strategys_own_code(tiled_mlp, tiled_loss):
    """Tiled MLP and tiled loss in the trace against the real CPU step with the same switches (byte for byte)."""
    from lightning_ulysses.models import memory

    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    memory.enable(model, memory.MemoryFeatures(tiled_mlp, tiled_loss, False), None)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 1024))
    targets = {"shift_labels": ids} if tiled_loss else {"labels": ids}
    with TensorMemoryTracker() as tracker:
        model(input_ids=ids, **targets).loss.backward()
    traced = trace_step(CONFIG, 1024, tiled_mlp=tiled_mlp, tiled_loss=tiled_loss)
    assert traced.peak == tracker.result().peak_bytes
    assert traced.peak < trace_step(CONFIG, 1024).peak


def test_offloaded_checkpoints_leave_the_device_for_the_host():
    """With offload_checkpoints the layers are checkpointed and their saved inputs held in host memory (as on an
    accelerator; on CPU the strategy keeps them where they are)."""
    plain = trace_step(CONFIG, 4096)
    offloaded = trace_step(CONFIG, 4096, offload_checkpoints=True)
    checkpointed = trace_step(CONFIG, 4096, gradient_checkpointing=True)
    assert offloaded.peak < checkpointed.peak < plain.peak
    assert offloaded.host >= CONFIG.num_hidden_layers * 4096 * CONFIG.hidden_size * 4  # each layer's input at least
    assert plain.host == checkpointed.host == 0


def test_ring_attention_is_traced_with_the_strategys_own_ring_code():
    """``ring_size`` runs the strategy's ring attention in the trace (its passes as receive buffers): at 16 heads over
    sp=8 the Ulysses-only plan is refused and the ring's is made; with the ring the step keeps what Ulysses keeps
    (the same q/k/v and output bytes per rank; measured against launched runs: tests/profiling/test_tensor_memory.py,
    benchmarks/plan_accuracy.py)."""
    from lightning_ulysses.parallel import ring

    calls = []
    original = ring.ring_attention
    ring.ring_attention = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        ringed = plan_memory(CONFIG, 8192, sp_size=4, ring_size=2, stage=2, reduce_bucket_size=1_000_000)
    finally:
        ring.ring_attention = original
    assert len(calls) == CONFIG.num_hidden_layers
    ulysses = plan_memory(CONFIG, 8192, sp_size=4, stage=2, reduce_bucket_size=1_000_000)
    assert ringed.ring_size == 2 and "(ring 2)" in ringed.table()
    assert ringed.step == pytest.approx(ulysses.step, rel=0.05)


def test_zero3_holds_a_module_and_what_it_prefetches():
    """DeepSpeed gathers a module's partitioned parameters while it runs and prefetches the next ones up to
    ``stage3_prefetch_bucket_size`` elements: a small model is in flight whole, a large one its biggest module and
    one prefetch bucket; parameters under the persistence threshold are never gathered."""
    small = ((100,), (300, 10), (200,))
    assert zero3_gathered_elements(small, 0, 50_000_000) == 610
    assert zero3_gathered_elements(small, 150, 50_000_000) == 500  # the 100- and 10-element ones stay whole
    big = ((500,), (100,), (100,), (100,), (500,))  # embedding, three layers, LM head
    assert zero3_gathered_elements(big, 0, 150) == 500 + 200  # the head and two layers (the bucket overshoots)
    assert zero3_gathered_elements(big, 0, 0) == 500
    plan = plan_memory(CONFIG, 4096, sp_size=2, stage=3, persistence_threshold=0)
    assert plan.zero3_gathered == sum(p.numel() for p in LlamaForCausalLM(CONFIG).parameters()) * 2  # bf16, whole


def test_parameter_offload_leaves_the_persistent_parameters_on_the_device():
    on_device = plan_memory(CONFIG, 4096, sp_size=1, stage=3, offload_optimizer=True, persistence_threshold=0)
    offloaded = plan_memory(CONFIG, 4096, sp_size=1, stage=3, offload_optimizer=True, offload_parameters=True,
                            persistence_threshold=0)
    assert offloaded.states.parameters == 0 and on_device.states.parameters > 0
    assert offloaded.states.host == on_device.states.host + on_device.states.parameters
    assert offloaded.zero3_gathered == on_device.zero3_gathered  # what runs is gathered onto the device all the same
    assert offloaded.peak == on_device.peak - on_device.states.parameters


def _qwen2_5_vl_config():
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=128, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16,
                  fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=1020, video_token_id=1021,
                            vision_start_token_id=1022, vision_end_token_id=1023)


def test_a_vision_tower_is_traced_from_its_grids():
    """A Qwen-VL-style tower runs on the meta device with its image grid's real values (positions, windows): what it
    keeps for backward matches the real CPU tower's (sdpa) within 3%, and halves when two SP ranks share the units
    (the launched comparison: benchmarks/plan_accuracy.py, +0.1% on a whole Qwen2.5-VL step)."""
    from transformers import AutoModelForImageTextToText

    from lightning_ulysses.plan.activations import _register, _vision_tower_kept, rank_vision_units

    grids = [(1, 16, 16), (4, 8, 8)]  # an image and a 4-temporal-patch video, in patches
    assert rank_vision_units(grids, 1) == [(1, 16, 16)] + [(1, 8, 8)] * 4
    assert rank_vision_units(grids, 2) in ([(1, 16, 16)], [(1, 8, 8)] * 4)  # 256 patches each
    config = _qwen2_5_vl_config()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    units = rank_vision_units(grids, 1)
    grid = torch.tensor(units)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)
    with TensorMemoryTracker() as tracker:
        encoded = model.model.visual(pixels, grid_thw=grid)
    real = tracker.result().end_bytes
    del encoded
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    traced = _vision_tower_kept(meta, units, _register(1))
    assert traced == pytest.approx(real, rel=0.03), (traced, real)
    one = plan_memory(config, 2048, sp_size=1, precision="32-true", optimizer="sgd", vision_grids=grids)
    two = plan_memory(config, 2048, sp_size=2, precision="32-true", optimizer="sgd", vision_grids=grids)
    kind = "vision tower (kept for backward)"
    assert one.step_by_kind[kind] == pytest.approx(2 * two.step_by_kind[kind], rel=0.1), (one, two)


def test_a_built_model_is_planned_from_its_config():
    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIG)
    assert plan_memory(model, 2048, sp_size=2).peak == plan_memory(CONFIG, 2048, sp_size=2).peak
    with pytest.raises(ValueError, match="has no .config to plan from"):
        plan_memory(torch.nn.Linear(2, 2), 2048)


@pytest.mark.parametrize("sp,tokens,chunk", [(2, 2048, 512), (4, 1024, 512), (2, 1500, 1000), (1, 4096, 1024)])
def test_offload_attention_traced_on_its_nearest_blocks_has_every_blocks_peak(monkeypatch, sp, tokens, chunk):
    """The planner traces ``offload_attention`` on each query chunk's two nearest key chunks (fast: ~4 kernel calls
    per chunk); its peak and host bytes must be those of the trace over every block. sp 2 and 4: the exchange per
    chunk (1500 tokens per rank in pieces of 500: a short last piece); sp 1: the chunks of the whole sequence."""
    from lightning_ulysses.plan import activations

    config = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})
    kwargs = dict(sp=sp, attention_chunk=chunk, gradients_leave=True, offload_checkpoints=True, tiled_loss="auto")
    sampled = trace_step(config, tokens, **kwargs)
    monkeypatch.setattr(activations, "SAMPLE_CHUNK_BLOCKS", False)
    every = trace_step(config, tokens, **kwargs)
    assert (sampled.peak, sampled.host) == (every.peak, every.host)
    assert sampled.peak < trace_step(config, tokens, sp=sp, gradients_leave=True, offload_checkpoints=True,
                                     tiled_loss="auto").peak


def test_a_litgpt_config_is_planned_as_its_real_step():
    """LitGPT's GPT from a LitGPT Config: the meta trace against the real CPU step (SDPA's flash kernel for CPU,
    LitGPT's cross-entropy over the logits), counted by the same tracker; the RoPE cache (a model buffer the real
    step does not allocate) is the one difference. Under SP the step is a rank's; what the strategy refuses for
    LitGPT is refused by the plan."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(block_size=4096, vocab_size=1000, padded_vocab_size=1024, n_layer=2, n_head=8, n_query_groups=2,
                    n_embd=128, intermediate_size=352, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
                    bias=False, rotary_percentage=1.0, parallel_residual=False)
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (1, 1024))
    with TensorMemoryTracker() as tracker:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        del logits
        loss.backward()
    from lightning_ulysses.plan.activations import trace_litgpt_step

    traced = trace_litgpt_step(config, 1024)
    rope = traced.by_kind["RoPE cache (cos, sin)"]
    assert rope == 2 * 4096 * 16 * 4  # block_size x rope_n_elem, float32, cos and sin
    # CPU's flash kernel returns [B, n_head, T, hs] (GPU kernels: [B, T, n_head, hs], as the plan's): LitGPT's reshape
    # after its transpose copies it: one [T, n_embd] tensor more per layer (the copy the output projection keeps)
    assert tracker.result().peak_bytes - (traced.peak - rope) == config.n_layer * 1024 * 128 * 4
    assert traced.parameters == sum(p.numel() for p in model.parameters())
    # planned from the config and from the built model alike; sp 2 halves the step's activations
    one = plan_memory(config, 2048, sp_size=1, stage=2, precision="32-true", reduce_bucket_size=100_000)
    assert plan_memory(model, 2048, sp_size=1, stage=2, precision="32-true", reduce_bucket_size=100_000) == one
    two = plan_memory(config, 2048, sp_size=2, stage=2, precision="32-true", reduce_bucket_size=100_000)
    assert two.step < 0.6 * one.step
    for refused, match in (({"ring_size": 2}, "ring_size=1"), ({"tiled_mlp": "auto"}, "tiled_mlp.*LitGPT"),
                           ({"offload_attention": True}, "offload_attention.*LitGPT")):
        with pytest.raises(ValueError, match=match):
            plan_memory(config, 2048, **{"sp_size": 2, **refused})
    with pytest.raises(ValueError, match="fewer heads than sp_size=16"):
        plan_memory(config, 4096, sp_size=16)


def test_the_command_plans_a_litgpt_model_by_name(capsys):
    assert main(["--litgpt", "pythia-14m", "--seq-len", "512", "--sp", "1", "2", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["sp_size"] for p in plans] == [1, 2] and plans[1]["step"] < plans[0]["step"]
    assert plans[0]["parameters"] == 14_067_712  # LitGPT's pythia-14m (untied embedding and head, padded vocab)
    assert "LitGPT" in plans[0]["step_cost"]  # no step cost for LitGPT configs (said so)
    assert main(["--litgpt", "pythia-14m", "--seq-len", "4096", "--sp", "2", "--json"]) == 0
    assert "longer than the LitGPT config's block_size 512" in json.loads(capsys.readouterr().out)[0]["error"]


def test_a_hybrids_gated_delta_rule_is_planned_by_its_calibrated_line(monkeypatch):
    """transformers' torch fallback of the chunked gated delta rule is traced for real at 3 and 5 chunks and planned
    by the line through them (a hybrid's plan took 90 s at 16K tokens per rank, op by op): the whole step's peak and
    host bytes as the trace of every chunk counts them, plain and with the memory switches, and the line meets a real
    trace at 9 chunks."""
    from transformers import AutoConfig

    from lightning_ulysses.plan import activations

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        pad_token_id=0)
    # Qwen3-Next's mixer hands the rule views of its convolution's output, which the rule saves (keeping the whole
    # output alive): the plan's function saves the same inputs (at sp 1 the step's peak was 18 MiB under without)
    next_config = AutoConfig.for_model(
        "qwen3_next", vocab_size=512, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        head_dim=32, linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0)
    activations._delta_rule_lines.clear()
    for model, tokens, switches in ((config, 1024, {}),
                                    (config, 1024, {"tiled_mlp": "auto", "tiled_loss": "auto",
                                                    "offload_checkpoints": True}),
                                    (next_config, 2048, {"gradient_buffer_bytes": 8_000_000})):
        planned = trace_step(model, tokens, gradients_leave=True, **switches)
        with monkeypatch.context() as patched:
            patched.setattr(activations, "_calibrated_delta_rule", lambda original: original)
            every = trace_step(model, tokens, gradients_leave=True, **switches)
        assert planned.host == every.host
        if switches.get("offload_checkpoints"):
            # recomputed under checkpointing, the saved query and key views are all that keeps the convolution's
            # output: the real rule lets it go part-way through its backward, the plan's function at its end (one
            # [s, q heads, D] tensor more at that layer's peak: 2% here, never under)
            assert every.peak <= planned.peak <= every.peak + tokens * 4 * 32 * 4, switches
        else:
            assert planned.peak == every.peak, switches
    activations._delta_rule_lines.clear()
    trace_step(config, 1024)
    assert activations._delta_rule_lines  # the line was used
    (signature, line), = activations._delta_rule_lines.items()
    original, inputs, chunk_size, flags = signature
    like = tuple((b, dtype, (b, 0, *rest), grad) for b, dtype, rest, grad in inputs)
    nine = activations._delta_rule_memory(original, 9, like, chunk_size, dict(flags))
    first = activations._CALIBRATION_CHUNKS[0]
    assert nine == tuple(round(line[2 * i] + line[2 * i + 1] * (9 - first)) for i in range(3))


@pytest.mark.parametrize("tokens,switches", [
    (1536, {"tiled_mlp": "auto", "tiled_loss": 12, "offload_checkpoints": True}),
    (1000, {"tiled_mlp": 5, "tiled_loss": 7, "offload_checkpoints": True}),
    (1000, {"tiled_loss": 4}), (1000, {"tiled_mlp": 8, "tiled_loss": 5})])
def test_the_tiled_mlp_and_loss_traced_on_three_tiles_have_every_tiles_peak(monkeypatch, tokens, switches):
    """The planner runs the first two and the last of the ALST switches' tiles (MLP tiles, loss chunks; a loss chunk
    not run leaves what its checkpoint leaves: its saved inputs, a gradient autograd holds until the split takes
    every chunk's): the peak and host bytes of the trace over every tile, even and uneven tiles, with and without
    the checkpoints offloaded."""
    from lightning_ulysses.plan import activations

    config = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 1})
    kwargs = dict(gradients_leave=True, **switches)
    sampled = trace_step(config, tokens, **kwargs)
    monkeypatch.setattr(activations, "SAMPLE_TILES", False)
    every = trace_step(config, tokens, **kwargs)
    assert (sampled.peak, sampled.host) == (every.peak, every.host)


ALIKE = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0)
ALIKE_SETTINGS = {
    "plain": dict(),
    "sp2-zero2-bf16": dict(sp=2, dtype=torch.bfloat16, gradient_buffer_bytes=2**20, gradients_leave=True),
    "alst": dict(sp=2, tiled_mlp="auto", tiled_loss=8, offload_checkpoints=True, gradients_leave=True),
    "offload-attention": dict(sp=2, attention_chunk=512, offload_checkpoints=True, tiled_loss=4),
    "ring": dict(sp=4, ring=2),
    "model-checkpointing": dict(gradient_checkpointing=True),
    "moe": dict(sp=2, tiled_mlp="auto", offload_checkpoints=True),  # on ALIKE_MOE
}
ALIKE_MOE = AutoConfig.for_model("qwen3_moe", vocab_size=1024, hidden_size=128, intermediate_size=352, head_dim=16,
                                 num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                                 moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                 max_position_embeddings=8192, pad_token_id=0)


@pytest.mark.parametrize("name", list(ALIKE_SETTINGS))
def test_a_model_of_alike_layers_is_planned_from_two_and_three_to_the_byte(name):
    """A model whose decoder layers are all alike is traced with 2 and 3 layers and planned along the line through
    them: the same peak, parts, host bytes and parameter counts as the trace of all 6 layers, for each switch."""
    from lightning_ulysses.plan.activations import trace_layers, uniform_layers

    config = ALIKE_MOE if name == "moe" else ALIKE
    assert uniform_layers(config) == 6
    sampled = trace_step(config, 2048, **ALIKE_SETTINGS[name])
    whole = trace_layers(config, 2048, **ALIKE_SETTINGS[name])
    assert (sampled.peak, sampled.host) == (whole.peak, whole.host)
    assert {k: v for k, v in sampled.by_kind.items() if v} == {k: v for k, v in whole.by_kind.items() if v}
    assert (sampled.parameters, sampled.trainable, sampled.numels, sampled.largest_layer, sampled.module_numels) == (
        whole.parameters, whole.trainable, whole.numels, whole.largest_layer, whole.module_numels)


def test_models_whose_layers_differ_are_traced_whole():
    """Layers that differ (alternating sliding windows, a hybrid's mixers, dense layers before the experts) are not
    sampled: the plan traces them all."""
    from transformers import AutoConfig

    from lightning_ulysses.plan.activations import uniform_layers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    assert uniform_layers(AutoConfig.for_model("qwen3_moe", moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, **common)) == 6
    assert uniform_layers(AutoConfig.for_model("gemma3_text", head_dim=16, **common)) is None  # windows alternate
    assert uniform_layers(AutoConfig.for_model(
        "qwen3_5_text", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, **common)) is None  # gated delta nets and attention
    assert uniform_layers(AutoConfig.for_model(
        "qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
        **common)) is None  # a dense layer before the experts


def test_the_longest_sequence_can_be_bound_by_the_host_memory_the_checkpoints_take():
    """With checkpoints offloaded the host memory grows with the sequence too: given a host budget per rank, the
    longest sequence is the longest whose device peak and host bytes both fit (one step longer, one of them does
    not)."""
    settings = dict(sp_size=2, world_size=2, stage=2, precision="32-true", tiled_mlp="auto", tiled_loss="auto",
                    offload_checkpoints=True, reduce_bucket_size=1_000_000)
    budget = 64 * 2**20
    device_only = longest_sequence(CONFIG, budget, **settings)
    host_at_longest = plan_memory(CONFIG, device_only, **settings)
    host_budget = (host_at_longest.states.host + host_at_longest.host_checkpoints) // 2
    bound = longest_sequence(CONFIG, budget, host_budget_bytes=host_budget, **settings)
    assert 0 < bound < device_only
    fits, longer = plan_memory(CONFIG, bound, **settings), plan_memory(CONFIG, bound + 1024, **settings)
    assert fits.peak <= budget and fits.states.host + fits.host_checkpoints <= host_budget
    assert longer.peak > budget or longer.states.host + longer.host_checkpoints > host_budget

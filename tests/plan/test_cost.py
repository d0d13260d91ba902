"""A step's FLOPs, bytes sent and time estimate, and the recommendation of the fastest setting that fits
(``lightning_ulysses/plan/cost.py``). The FLOPs are checked against torch's own FLOP counter on a real forward and
backward; the exchange against the all-to-alls' shapes. In-process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses.plan.cost import Recommendation, matmul_parameters, recommend, step_cost, step_seconds
from lightning_ulysses.plan.planner import DEVICES, GIB

CONFIG = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)


def test_the_flops_are_what_torch_counts_for_a_forward_and_backward():
    model = LlamaForCausalLM._from_config(CONFIG, attn_implementation="eager")  # attention as counted matmuls
    ids = torch.randint(0, 1024, (2, 256))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops()
    # eager attention computes every score, masked or not: attention_fraction 1
    planned = step_cost(CONFIG, 256, micro_batch=2, precision="32-true", attention_fraction=1.0).flops
    assert planned == counted, (planned, counted)  # every matmul of the step, exactly


def test_sequence_parallelism_divides_the_flops_and_exchanges_the_heads():
    one, four = step_cost(CONFIG, 4096, sp_size=1), step_cost(CONFIG, 4096, sp_size=4)
    assert four.flops == pytest.approx(one.flops / 4) and one.all_to_all_bytes == 0
    # per layer, forward and backward: q, k, v and the output of the shard's s = 1024 tokens, 3/4 of it leaves
    element = torch.bfloat16.itemsize
    expected = 2 * 1024 * (2 * 8 + 2 * 2) * 16 * 2 * 3 / 4 * element
    assert four.all_to_all_bytes == pytest.approx(expected)
    recomputed = step_cost(CONFIG, 4096, sp_size=4, recompute=True)
    assert recomputed.flops == pytest.approx(four.flops * 8 / 6)  # a second forward in backward
    assert step_cost(CONFIG, 4096, sp_size=4, world_size=8, stage=3).zero_bytes == pytest.approx(
        1.5 * step_cost(CONFIG, 4096, sp_size=4, world_size=8, stage=2).zero_bytes)
    assert matmul_parameters(CONFIG) == 2 * (128 * 128 + 2 * 128 * 32 + 128 * 128 + 3 * 128 * 352) + 128 * 1024


def test_a_group_across_nodes_is_slower_than_one_inside_a_node():
    cost = step_cost(CONFIG, 65536, sp_size=8, world_size=16)
    inside = step_seconds(cost, DEVICES["h100"], sp_size=8, devices_per_node=8, nodes=2)
    across = step_seconds(cost, DEVICES["h100"], sp_size=8, devices_per_node=4, nodes=4)
    assert across > inside > 0


def test_the_recommendation_fits_and_ranks_by_throughput():
    """ZeRO 3 on 4 devices, the optimizer on the device. Planned peaks (GiB) without / with the memory switches:
    sp=1 1.12 / 0.57, sp=2 0.76 / 0.57, sp=4 0.57 / 0.47."""
    choices = {"stages": (3,), "offload_optimizer": (False,)}
    roomy = recommend(CONFIG, 32768, devices_per_node=4, device="h100", budget_bytes=10 * GIB, **choices)
    # everything fits without the switches, which would only add recompute; data parallelism wins: four sequences
    # per step, no exchange
    assert [(r.sp_size, r.memory_switches) for r in roomy] == [(1, False), (2, False), (4, False)]
    assert [r.tokens_per_second for r in roomy] == sorted((r.tokens_per_second for r in roomy), reverse=True)
    # at 0.6 GiB sp=4 fits without the switches and beats the settings that need their recompute
    fitting = recommend(CONFIG, 32768, devices_per_node=4, device="h100", budget_bytes=int(0.6 * GIB), **choices)
    assert [(r.sp_size, r.memory_switches) for r in fitting] == [(4, False), (1, True), (2, True)]
    assert all(isinstance(r, Recommendation) and r.plan.peak <= 0.6 * GIB for r in fitting)
    assert fitting[0].strategy_arguments() == {"sp_size": 4, "stage": 3}
    tight = recommend(CONFIG, 32768, devices_per_node=4, device="h100", budget_bytes=int(0.5 * GIB), **choices)
    assert [(r.sp_size, r.memory_switches) for r in tight] == [(4, True)]
    assert tight[0].strategy_arguments() == {"sp_size": 4, "stage": 3, "tiled_mlp": "auto", "tiled_loss": "auto",
                                             "offload_checkpoints": True}
    assert recommend(CONFIG, 32768, devices_per_node=4, device="h100", budget_bytes=1, **choices) == []


def test_a_mixture_of_experts_costs_the_experts_a_token_picks():
    """Mixtral-shaped, 8 experts, 2 per token: the step's matmul FLOPs are those of 2 experts' MLPs (and the router),
    not 8; an MoE config without a count of experts per token is refused naming the keys read."""
    from transformers import MixtralConfig

    sizes = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2)
    two = step_cost(MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **sizes), 1024, attention_fraction=0)
    eight = step_cost(MixtralConfig(num_local_experts=8, num_experts_per_tok=8, **sizes), 1024, attention_fraction=0)
    assert 0.3 * eight.flops < two.flops < 0.5 * eight.flops  # the experts are most of the weights, not all
    unknown = LlamaConfig(**sizes)
    unknown.num_experts = 8  # experts, and none of the keys that say how many a token picks
    with pytest.raises(ValueError, match="experts picked per token"):
        step_cost(unknown, 1024)
    found = recommend(MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **sizes), 8192, devices_per_node=4,
                      device="h100")
    assert found and found[0].tokens_per_second > 0


def test_the_command_gives_each_plans_cost_and_a_recommendation(tmp_path, capsys):
    import json

    from lightning_ulysses.plan.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(CONFIG.to_json_string())
    assert main(["--config", str(path), "--seq-len", "4096", "--sp", "2", "--gpus", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)[0]
    assert plan["step_cost"] == {"flops": step_cost(CONFIG, 4096, sp_size=2, world_size=4,
                                                     parameters=plan["parameters"]).flops,
                                 "all_to_all_bytes": plan["step_cost"]["all_to_all_bytes"],
                                 "zero_bytes": plan["step_cost"]["zero_bytes"], "ring_bytes": 0.0}
    assert plan["step_cost"]["all_to_all_bytes"] > 0 and plan["step_cost"]["zero_bytes"] > 0
    assert main(["--config", str(path), "--seq-len", "4096", "--device", "h100", "--gpus-per-node", "2",
                 "--recommend", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and ranked[0]["strategy"] == {"sp_size": 1, "stage": 2}  # everything fits an H100: plain DP, ZeRO 2
    assert all(entry["peak"] <= DEVICES["h100"].tensor_bytes for entry in ranked)  # the memory less the fixed cost

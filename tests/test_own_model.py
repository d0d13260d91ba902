"""Models that are not Hugging Face models, and head counts that sp_size does not divide.

- the public ``ulysses_attention`` equals full attention, forward and backward (float64, so exact to 1e-12), for
  MHA/GQA/MQA, causal and not, even and uneven head splits, on 2 and 4 processes; 2 all-to-alls forward + 2 backward;
- the example's from-scratch GPT trained with ``attention_modules=[AttentionCore]`` matches its single-device run
  at ZeRO 2 and 3, also with 3 heads at sp 2;
- a Hugging Face Llama with uneven heads (3 heads at sp 2; 6 heads at sp 4) matches its single-device run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.launcher import launch
from tests.support.models import SEED, TokenDataset, lightning_order
from tests.scenarios.own_model import load_gpt_example
from tests.test_parity import _run, check_against_reference, rel_diff, update_rel_diff

WRAPPER_2 = [dict(B=2, S=16, Hq=hq, Hkv=hkv, causal=c) for hq, hkv in [(4, 4), (4, 2), (4, 1), (3, 3), (6, 3), (3, 1)]
             for c in (True, False)]
WRAPPER_4 = [dict(B=1, S=16, Hq=hq, Hkv=hkv, causal=True) for hq, hkv in [(6, 6), (6, 3), (8, 2), (4, 1), (5, 5)]]
GPT_RUNS = [dict(stage=stage, heads=heads, kv_heads=kv, sp_size=2, steps=4, seq_len=32, num_rows=4, lr=0.5)
            for stage, heads, kv in [(2, 4, 2), (3, 4, 2), (2, 3, 3)]]
# The step calls `gpt(input_ids)`: the GPT's default positions (0..T-1) would restart on every shard; the strategy
# passes the shard's global positions to the module around the attention cores whose forward takes `position_ids`.
GPT_RUNS.append(dict(GPT_RUNS[0], omit_positions=True))
HF_UNEVEN_2 = [_run(2, 3, sp_size=2, batch_size=1, num_rows=4, num_heads=3)]
HF_UNEVEN_4 = [_run(2, 6, sp_size=4, batch_size=1, num_rows=4, num_heads=6),
               _run(3, 3, sp_size=4, batch_size=1, num_rows=4, num_heads=6)]


@pytest.fixture(scope="module")
def two():
    return launch(2, "combined:run", {"wrapper": ["own_model:wrapper_checks", {"cases": WRAPPER_2}],
                                  "gpt": ["own_model:gpt_parity", {"runs": GPT_RUNS}],
                                  "hf": ["parity:run", {"runs": HF_UNEVEN_2}]})


@pytest.fixture(scope="module")
def four():
    return launch(4, "combined:run", {"wrapper": ["own_model:wrapper_checks", {"cases": WRAPPER_4}],
                                  "hf": ["parity:run", {"runs": HF_UNEVEN_4}]})


def _check_wrapper(results):
    for rank in results:
        for case in rank["wrapper"]:
            assert max(case["errors"].values()) < 1e-12, case
            assert case["out_shape"] == (case["B"], case["Hq"], case["S"] // len(results), 8)
            assert case["collectives"] == {"alltoall_base_": 4}, case  # 2 forward + 2 backward


def test_wrapper_matches_full_attention_on_2_processes(two):
    _check_wrapper(two)


def test_wrapper_matches_full_attention_with_uneven_heads_on_4_processes(four):
    _check_wrapper(four)


def gpt_reference(run):
    gpt = load_gpt_example()
    torch.manual_seed(SEED)
    cfg = gpt.GPTConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=run["heads"], n_kv_head=run["kv_heads"],
                        n_embd=8 * run["heads"])
    model = gpt.GPTModule(cfg, lr=run["lr"], optimizer="sgd")
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=run["lr"])
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    losses = []
    for i in lightning_order(len(dataset))[:run["steps"]]:
        ids = dataset[i]["input_ids"][None]
        logits = model.gpt(ids, torch.arange(ids.shape[1])[None])
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}, initial


@pytest.mark.parametrize("index", range(len(GPT_RUNS)),
                         ids=[f"zero{r['stage']}-{r['heads']}heads" + ("-no-positions" if r.get("omit_positions")
                                                                        else "") for r in GPT_RUNS])
def test_gpt_from_scratch_matches_single_device(two, index):
    run = GPT_RUNS[index]
    losses, weights, initial = gpt_reference(run)
    for rank in two:
        result = rank["gpt"][index]
        assert set(result["input_shapes"]) == {(1, run["seq_len"] // 2)}  # each rank holds half the sequence
        assert rel_diff(result["losses"], losses) <= 1e-5, (result["losses"], losses)
        assert result["unwrapped"]  # the attention cores are plain modules again after fit
    assert update_rel_diff(two[0]["gpt"][index]["weights"], weights, initial) <= 1e-5


def test_shard_positions_are_the_global_positions_of_the_shard(two):
    """``strategy.shard_positions(s)`` (for an own model's position embeddings) is this rank's slice of the global
    positions, the batch's own ``position_ids``."""
    for rank, result in enumerate(two):
        for run in result["gpt"]:
            s = run["input_shapes"][0][1]
            assert run["shard_positions"] and all(mine == list(range(rank * s, (rank + 1) * s)) == batch
                                                  for mine, batch in run["shard_positions"])


def test_hf_model_with_3_heads_at_sp2_matches_single_device(two):
    check_against_reference(HF_UNEVEN_2[0], [rank["hf"]["runs"][0] for rank in two], global_batch=1)
    assert two[0]["hf"]["runs"][0]["attention_query_shapes"] == [(1, 2, 32, 16)]  # busiest rank: 2 of 3 heads


@pytest.mark.parametrize("index", range(len(HF_UNEVEN_4)), ids=["zero2-gqa-6q3kv", "zero3-gqa-6q3kv"])
def test_hf_model_with_6_heads_at_sp4_matches_single_device(four, index):
    check_against_reference(HF_UNEVEN_4[index], [rank["hf"]["runs"][index] for rank in four], global_batch=1)
    heads_per_rank = [rank["hf"]["runs"][index]["attention_query_shapes"][0][1] for rank in four]
    assert heads_per_rank == [2, 2, 1, 1]

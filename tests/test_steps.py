"""Your own ``training_step``, unchanged: every way of writing it trains exactly like one device under SP, or stops on
every rank before a single weight changes.

Each row of the "Your training_step" table of docs/data-and-training-step.md is a case of ``tests/scenarios/steps.py`` (SGD, fp32, 4 optimizer
steps, real gloo processes) compared with the same step written for one device in plain PyTorch + transformers (no
Lightning, no DeepSpeed): per-step losses and the weight update within 1e-5 relative, at ZeRO 2 and 3 (and 0/1 for
terms that are the same on every rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.launcher import launch
from tests.support.models import SEED, build_llama, documents_as_rows, pad_right_collate, tiny_llama_config
from tests.scenarios.steps import _dataset

LR = 0.5
STEPS = 4
REL_TOL = 1e-5
WITHIN_SECONDS = 60  # a refused step stops every rank within seconds (a hang would last until gloo's timeout)


# ----------------------------------------------------------------------------------------------- references
def _model_loss(model, b):
    return model(input_ids=b["input_ids"], labels=b["labels"]).loss


def _with_mask(model, b):
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss


def _regularised(model, b):
    return _model_loss(model, b) + 1e-3 * sum(p.float().pow(2).sum() for p in model.parameters())


def _scaled_plus_aux(model, b):
    out = model(input_ids=b["input_ids"], labels=b["labels"])
    z = out.logits.float().logsumexp(-1).pow(2)[:, :-1]  # the positions that have a target
    return out.loss * 0.5 + 1e-2 * z.mean()


def _squared_global_mean(model, b):
    out = model(input_ids=b["input_ids"], labels=b["labels"])
    z = out.logits.float().logsumexp(-1)[:, :-1]
    return out.loss + 1e-2 * (z.mean() - 4.0).pow(2)  # a nonlinear function of a whole-batch mean


def _token_losses(model, b):
    logits = model(input_ids=b["input_ids"]).logits[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), b["labels"][:, 1:], reduction="none")  # [B, S-1]


def _weighted_tokens(model, b):
    tok = _token_losses(model, b)
    w = b["token_weight"][:, 1:] * b["sample_weight"][:, None]  # the weight of each target token
    return (tok * w).sum() / w.sum()


def _sample_weighted(model, b):
    tok = _token_losses(model, b)
    w = b["sample_weight"][:, None].expand_as(tok)
    return (tok * w).sum() / w.sum()


def _edited_labels(model, b):
    return model(input_ids=b["input_ids"], labels=b["labels"].masked_fill(b["labels"] < 40, -100)).loss


REFERENCE = {
    "edited_labels": _edited_labels,
    "model_loss": _model_loss, "labels_no_positions": _model_loss, "positional_args": _model_loss,
    "labels_are_input_ids": _model_loss, "helper_no_positions": _model_loss,
    "shift_labels_no_positions": _model_loss, "mask_and_labels": _with_mask, "regulariser": _regularised,
    "scaled_plus_token_mean_aux": _scaled_plus_aux,
    "squared_global_mean": _squared_global_mean, "weighted_tokens": _weighted_tokens,
    "token_mean_of_token_losses": _sample_weighted,
}


def sample_order(num_rows: int, epoch: int) -> list[int]:
    """The order of Lightning's DistributedSampler (shuffle, seed = global seed) in ``epoch``."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def reference_windows(case: dict, num_rows: int) -> list[list[int]]:
    """Row indices of every optimizer step on one device: Lightning's accumulation windows (every k micro-batches
    and at the end of each epoch), each trained as one batch (token-weighted, like one larger batch)."""
    k, b = case.get("trainer", {}).get("accumulate_grad_batches", 1), case.get("global_batch", 1)
    windows, epoch = [], 0
    while len(windows) < case.get("max_steps", STEPS):
        order = sample_order(num_rows, epoch)
        micro = [order[i:i + b] for i in range(0, num_rows, b)]
        windows += [sum(micro[i:i + k], []) for i in range(0, len(micro), k)]
        epoch += 1
    return windows[:case.get("max_steps", STEPS)]


def train_reference(case: dict) -> dict:
    if case.get("arch"):
        from tests.support.architectures import build_model

        model = build_model(case["arch"])
    else:
        model = build_llama(tiny_llama_config(num_kv_heads=2), init_seed=0)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=case.get("lr", LR))
    dataset = _dataset(case)
    collate = pad_right_collate if case.get("data") == "padded" else torch.utils.data.default_collate
    losses = []
    for rows in reference_windows(case, len(dataset)):
        if case.get("data") == "packed":  # the same documents, each its own row
            batch = documents_as_rows(dataset, rows)
        else:
            batch = collate([dataset[i] for i in rows])
        loss = REFERENCE[case["reference"]](model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()},
            "initial": initial}


def update_rel_diff(weights: dict, reference: dict, initial: dict) -> float:
    num = sum(((weights[k].double() - reference[k].double()) ** 2).sum() for k in reference)
    den = sum(((reference[k].double() - initial[k].double()) ** 2).sum() for k in reference)
    return (num / den).sqrt().item()


def worst_parameter_update_diff(weights: dict, reference: dict, initial: dict) -> float:
    """The largest per-parameter |Δw - Δw_ref| / |Δw_ref| (parameters the reference moved)."""
    worst = 0.0
    for k in reference:
        moved = (reference[k].double() - initial[k].double()).norm()
        if moved > 0:
            worst = max(worst, ((weights[k].double() - reference[k].double()).norm() / moved).item())
    return worst


# ----------------------------------------------------------------------------------------------- cases
def _exact(step: str, stage: int, reference: str = None, **extra) -> dict:
    return {"name": f"{step}-zero{stage}", "step": step, "stage": stage, "reference": reference or step, **extra}


EXACT = [
    *(_exact(step, stage, "model_loss") for stage in (2, 3) for step in
      ("labels_no_positions", "positional_args", "labels_are_input_ids", "helper_no_positions",
       "shift_labels_no_positions")),
    *(_exact("mask_and_labels", stage, data="padded", batch_size=2, global_batch=2) for stage in (2, 3)),
    *(_exact("regulariser", stage) for stage in (0, 1, 2)),
    *(_exact("edited_labels", stage) for stage in (2, 3)),
    *(_exact("scaled_plus_token_mean_aux", stage) for stage in (2, 3)),
    *(_exact("squared_global_mean", stage) for stage in (0, 3)),
    *(_exact(step, stage, data="weighted", batch_size=2, global_batch=2) for stage in (2, 3)
      for step in ("weighted_tokens", "token_mean_of_token_losses")),
    *(_exact("model_loss", stage, manual=True, name=f"manual-zero{stage}") for stage in (2, 3)),
    # labels shifted across the zigzag shards of ring attention (two runs per rank), and across packed documents
    _exact("labels_no_positions", 2, "model_loss", name="labels_no_positions-ring2-zero2",
           strategy={"ring_size": 2}),
    _exact("weighted_tokens", 3, data="weighted", batch_size=2, global_batch=2, name="weighted_tokens-ring2-zero3",
           strategy={"ring_size": 2}),
    *(_exact("labels_no_positions", stage, "mask_and_labels", data="packed", name=f"packed-no-positions-zero{stage}",
             strategy={"sdpa_per_document": True}) for stage in (2, 3)),
    # 8 batches per epoch, windows of 3: Lightning steps after batches 3, 6, 8 of every epoch (one device: 11
    # micro-batches for 4 steps); DeepSpeed's own counter used to run across epochs (14 micro-batches).
    *(_exact("model_loss", stage, name=f"accumulate3-zero{stage}", trainer={"accumulate_grad_batches": 3})
      for stage in (2, 3)),
]
EXACT_NAMES = [case["name"] for case in EXACT]

# Refused before any weight changes, on every rank: (case, error type, phrases of the message).
REFUSED = {
    "own_shift": ("SPLossMismatchError", "differs between the ranks", "`logits[:, :-1]` against `input_ids[:, 1:]`",
                  "strategy.cross_entropy(out.logits, batch[\"shift_labels\"])"),
    "per_shard_cross_entropy": ("SPLossMismatchError", "differs between the ranks", "mean over this rank's tokens"),
    "aux_on_shard_logits": ("SPLossMismatchError", "differs between the ranks", "logits.pow(2).mean()",
                            "strategy.token_mean(values, weights)"),
    # its all-gather reduces the strategy's already reduced losses again: refused by the loss graph before backward
    "tutorial_loss": ("SPLossMismatchError", "values that were reduced over it already",
                      "DeepSpeed's / accelerate's Ulysses tutorial"),
    "shifted_inputs": ("ValueError", "one token short", "shift_labels"),
    "arange_positions": ("ValueError", "position_ids"),
    "custom_mask": ("ValueError", "attention_mask", "not this step's padding mask"),
}
REFUSED_CASES = [{"name": f"{step}-zero{stage}", "step": step, "stage": stage}
                 for step in REFUSED for stage in (2, 3)]
REFUSED_CASES.append({"name": "regulariser-zero3", "step": "regulariser", "stage": 3})
REFUSED_CASES += [{"name": f"per_shard_cross_entropy-manual-zero{stage}", "step": "per_shard_cross_entropy",
                   "stage": stage, "manual": True} for stage in (2, 3)]
REFUSED_CASES += [{"name": f"raw_backward-manual-zero{stage}", "step": "model_loss", "stage": stage, "manual": True,
                   "raw_backward": True} for stage in (2, 3)]

GENERATION = [{"name": f"generate-{ranks}-zero{stage}", "step": "model_loss", "stage": stage, "generate": ranks,
               "max_steps": 2} for ranks, stages in (("all", (0, 1, 2, 3)), ("rank0", (0, 1, 2))) for stage in stages]
GENERATION_NAMES = [case["name"] for case in GENERATION]


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "steps:run", {"cases": EXACT + REFUSED_CASES + GENERATION}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in by_rank[0]}


# DP × SP (4 processes: 2 replicas of 2 SP ranks): the gradient factors involve dp, and the sample order too.
DP_EXACT = [
    _exact("regulariser", 2, name="regulariser-dp2-zero2", global_batch=2),
    _exact("labels_no_positions", 3, "model_loss", name="labels_no_positions-dp2-zero3", global_batch=2),
    _exact("weighted_tokens", 3, data="weighted", batch_size=2, global_batch=4, name="weighted_tokens-dp2-zero3"),
    _exact("model_loss", 2, name="accumulate3-dp2-zero2", global_batch=2, trainer={"accumulate_grad_batches": 3}),
]
DP_EXACT_NAMES = [case["name"] for case in DP_EXACT]


@pytest.fixture(scope="module")
def dp_results():
    by_rank = launch(4, "steps:run", {"cases": DP_EXACT}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in by_rank[0]}


@pytest.mark.parametrize("name", DP_EXACT_NAMES)
def test_training_step_trains_like_one_device_with_data_parallel_replicas(dp_results, name):
    check_exact(DP_EXACT[DP_EXACT_NAMES.index(name)], dp_results[name])


@pytest.mark.parametrize("name", EXACT_NAMES)
def test_training_step_trains_like_one_device(results, name):
    check_exact(EXACT[EXACT_NAMES.index(name)], results[name])


def check_exact(case: dict, ranks: list[dict]) -> None:
    name = case["name"]
    for r in ranks:
        assert r["error_type"] is None, r["message"]
        assert r["global_step"] == case.get("max_steps", STEPS)
    reference = train_reference(case)
    micro_batches = sum(len(w) for w in reference_windows(case, 8)) // case.get("global_batch", 1)
    assert ranks[0]["steps"] == micro_batches  # the micro-batches one device consumes for these optimizer steps
    if "accumulate_grad_batches" not in case.get("trainer", {}):
        assert all(r["losses"] == ranks[0]["losses"] for r in ranks)  # the same number on every rank
        losses = torch.tensor(ranks[0]["losses"], dtype=torch.float64)
        expected = torch.tensor(reference["losses"], dtype=torch.float64)
        assert ((losses - expected).abs() / expected.abs()).max() <= REL_TOL, (losses, expected)
    weights, initial = ranks[0]["weights"], reference["initial"]
    worst = worst_parameter_update_diff(weights, reference["weights"], initial)
    print(f"[measured] {name}: worst per-parameter update difference {worst:.2e}")
    assert update_rel_diff(weights, reference["weights"], initial) <= REL_TOL
    assert worst <= 1e-4
    assert update_rel_diff(initial, reference["weights"], initial) == pytest.approx(1.0)  # training moved weights


@pytest.mark.parametrize("name", [case["name"] for case in REFUSED_CASES])
def test_wrong_training_step_stops_every_rank_before_a_weight_changes(results, name):
    step = name.rsplit("-zero", 1)[0].replace("-manual", "")
    if name == "regulariser-zero3":
        error_type, phrases = "ValueError", ("ZeRO stage 3", "partitioned", "weight_decay")
    elif step == "raw_backward":
        error_type, phrases = "ValueError", ("loss.backward()", "self.manual_backward(loss)")
    else:
        error_type, *phrases = REFUSED[step]
    for r in results[name]:
        assert r["error_type"] == error_type, (r["error_type"], r["message"])
        for phrase in phrases:
            assert phrase in r["message"], r["message"]
        assert r["global_step"] == 0
        assert r["steps"] <= 1
        assert r["seconds"] < WITHIN_SECONDS
        if r["weights_unchanged"] is not None:  # ZeRO 2: the weights are still the initial ones
            assert r["weights_unchanged"]


@pytest.mark.parametrize("name", GENERATION_NAMES)
def test_generate_during_fit(results, name):
    ranks = results[name]
    for r in ranks:
        assert r["error_type"] is None, r["message"]
        assert r["global_step"] == 2
    callers = ranks if "all" in name else ranks[:1]
    for r in callers:
        assert r["tokens"] is not None and len(r["tokens"][0]) == 12
        assert r["tokens"] == r["plain_tokens"]  # plain generation with the model's current weights
    assert callers[0]["tokens"] == callers[-1]["tokens"]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # training went on, the same on both ranks


def test_generate_on_rank_zero_alone_at_zero3_stops_with_a_clear_error():
    """Rank 0 fails fast with the explanation; its peer, already waiting in the next step's collective, ends when
    rank 0's process goes away (as torchrun would end it) instead of hanging."""
    case = {"name": "generate-rank0-zero3", "step": "model_loss", "stage": 3, "generate": "rank0", "max_steps": 2}
    ranks = launch(2, "steps:run", {"cases": [case]}, timeout=120,
                   extra_env={"ULYSSES_GENERATE_RENDEZVOUS_SECONDS": "5"})
    first = ranks[0]["generate-rank0-zero3"]
    assert first["error_type"] == "GenerationRendezvousError", first["message"]
    for phrase in ("ZeRO stage 3", "call generate() on all ranks", "ZeRO stage 1 or 2"):
        assert phrase in first["message"]
    assert first["seconds"] < WITHIN_SECONDS
    assert ranks[1]["generate-rank0-zero3"]["error_type"] is not None

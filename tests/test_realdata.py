"""Real data under SP, each case against a single-device run: batches of different lengths, micro-batch 2 with
right padding, packed documents vs the same documents as separate rows, gradient accumulation (token-weighted),
validation/test losses, corpus-level loss and perplexity, predict outputs, and sample accounting."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import (PackedDataset, VarLenDataset, documents_as_rows, lightning_order, pad_right_collate,
                          tiny_llama_config, train_on_batches)
from tests.test_parity import rel_diff, update_rel_diff
from tests.support.models import build_llama

REL_TOL = 1e-5

DATASETS = {
    "varlen": VarLenDataset([32, 27, 18, 31]),
    "padded": VarLenDataset([20, 32, 9, 27, 30, 14]),
    "packed": PackedDataset([[10, 14, 8], [20, 12], [7, 9, 16], [32]]),
    "accumulate": VarLenDataset([32, 12, 27, 20, 31, 9, 18, 25]),
}
CASES = {
    "varlen": {"dataset": DATASETS["varlen"]},
    "padded": {"dataset": DATASETS["padded"], "batch_size": 2, "collate_fn": pad_right_collate,
               "after": ("validate", "test", "predict"), "trainer": {"limit_val_batches": 1.0}},
    "padded_sharded_predict": {"dataset": DATASETS["padded"], "batch_size": 2, "collate_fn": pad_right_collate,
                               "strategy": {"gather_predictions": False}, "max_steps": 1, "after": ("predict",)},
    "packed": {"dataset": DATASETS["packed"], "strategy": {"sdpa_per_document": True}},
    "packed_plain_sdpa": {"dataset": PackedDataset([[10, 14, 8], [20, 12]])},
    "accumulate": {"dataset": DATASETS["accumulate"], "trainer": {"accumulate_grad_batches": 2}},
    "accumulate_zero3": {"dataset": DATASETS["accumulate"], "stage": 3, "trainer": {"accumulate_grad_batches": 2}},
}
DP_CASES = {"dp2_varlen": {"dataset": DATASETS["accumulate"]}}


@pytest.fixture(scope="module")
def sp2():
    results = launch(2, "realdata:run", {"cases": CASES})
    return results


@pytest.fixture(scope="module")
def dp2_sp2():
    return launch(4, "realdata:run", {"cases": DP_CASES})


def config():
    return tiny_llama_config(num_kv_heads=2)


def ordered_batches(dataset, batch_size, collate=pad_right_collate):
    order = lightning_order(len(dataset))
    return [collate([dataset[i] for i in order[j:j + batch_size]]) for j in range(0, len(dataset), batch_size)]


def assert_same_training(result, reference, compare_losses=True):
    if compare_losses:
        assert rel_diff(result["losses"], reference["losses"]) <= REL_TOL, (result["losses"], reference["losses"])
    initial = dict(build_llama(config()).named_parameters())
    assert update_rel_diff(result["weights"], reference["weights"], initial) <= REL_TOL


def test_batches_of_different_lengths(sp2):
    reference = train_on_batches(config(), ordered_batches(DATASETS["varlen"], 1))
    # 27 and 31 tokens are not multiples of sp=2: the collate step padded them (rank shapes show it)
    assert sorted({s[1] for s in sp2[0]["varlen"]["input_shapes"]}) == [9, 14, 16]
    for rank in sp2:
        assert rank["varlen"]["losses"] == sp2[0]["varlen"]["losses"]
    assert_same_training(sp2[0]["varlen"], reference)


def test_micro_batch_2_with_right_padding(sp2):
    reference = train_on_batches(config(), ordered_batches(DATASETS["padded"], 2))
    assert_same_training(sp2[0]["padded"], reference)


def _eval_reference():
    """Validation (no shuffle) on the weights trained by the padded case's reference."""
    dataset = DATASETS["padded"]
    trained = train_on_batches(config(), ordered_batches(DATASETS["padded"], 2))["model"]
    batches = [pad_right_collate([dataset[i], dataset[i + 1]]) for i in range(0, len(dataset), 2)]
    with torch.no_grad():
        outputs = [trained(**b) for b in batches]
    losses = [o.loss.item() for o in outputs]
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    corpus = sum(l * n for l, n in zip(losses, tokens)) / sum(tokens)
    return {"val_loss": sum(losses) / len(losses), "corpus": corpus, "batches": batches,
            "logits": [o.logits for o in outputs]}


@pytest.fixture(scope="module")
def eval_reference():
    return _eval_reference()


def test_validation_and_test_losses_equal_single_device(sp2, eval_reference):
    for rank in sp2:
        validate = rank["padded"]["validate"]
        assert validate["val_loss"] == pytest.approx(eval_reference["val_loss"], rel=REL_TOL)
        assert rank["padded"]["test"]["test_loss"] == pytest.approx(eval_reference["val_loss"], rel=REL_TOL)


def test_corpus_level_loss_and_perplexity_are_exact(sp2, eval_reference):
    corpus = eval_reference["corpus"]
    # the mean of batch means differs from the corpus mean here (batches hold different token counts)
    assert abs(corpus - eval_reference["val_loss"]) > 1e-4
    for rank in sp2:
        validate = rank["padded"]["validate"]
        assert validate["val_corpus_loss"] == pytest.approx(corpus, rel=REL_TOL)
        assert validate["val_perplexity"] == pytest.approx(math.exp(corpus), rel=REL_TOL)


def test_predict_returns_full_sequence_logits_on_every_sp_rank(sp2, eval_reference):
    for rank in sp2:
        predictions = rank["padded"]["predict"]
        assert len(predictions) == len(eval_reference["batches"])
        for logits, batch, expected in zip(predictions, eval_reference["batches"], eval_reference["logits"]):
            assert logits.shape == expected.shape  # [B, S, V]: gathered and the sp padding removed
            real = batch["attention_mask"].bool()  # pad positions' outputs are not defined by the contract
            assert rel_diff(logits[real], expected[real]) <= REL_TOL


def test_predict_can_keep_outputs_sharded(sp2):
    for rank_index, rank in enumerate(sp2):
        gathered = rank["padded"]["predict"]
        for shard, full in zip(rank["padded_sharded_predict"]["predict"], gathered):
            s = shard.shape[1]
            assert shard.shape[0] == full.shape[0] and 2 * s >= full.shape[1] > 2 * (s - 1)  # [B, S_pad/2, V]
    # the two ranks hold the two halves of the sequence, not copies
    assert not torch.equal(sp2[0]["padded_sharded_predict"]["predict"][0], sp2[1]["padded_sharded_predict"]["predict"][0])


def test_packed_documents_match_the_same_documents_as_separate_rows(sp2):
    dataset = DATASETS["packed"]
    order = lightning_order(len(dataset))
    reference = train_on_batches(config(), [documents_as_rows(dataset, [i]) for i in order])
    assert_same_training(sp2[0]["packed"], reference)


def test_packed_rows_on_plain_sdpa_fail_before_compute(sp2):
    for rank in sp2:
        error_type, message = rank["packed_plain_sdpa"]["error"]
        assert error_type == "ValueError"
        assert "packs several documents" in message and "sdpa_per_document=True" in message
        assert rank["packed_plain_sdpa"]["steps_run"] == 0


@pytest.mark.parametrize("case", ["accumulate", "accumulate_zero3"])
def test_gradient_accumulation_equals_one_larger_batch(sp2, case):
    # windows of 2 rows of different lengths: token-weighted like a batch of 2 (not the mean of two means)
    reference = train_on_batches(config(), ordered_batches(DATASETS["accumulate"], 2))
    result = sp2[0][case]
    assert result["global_step"] == 4 and len(result["losses"]) == 8
    assert_same_training(result, reference, compare_losses=False)


def test_dp2_sp2_weights_tokens_across_replicas(dp2_sp2):
    # each replica reads one row of a different length; the single device averages over both rows' tokens
    reference = train_on_batches(config(), ordered_batches(DATASETS["accumulate"], 2))
    result = dp2_sp2[0]["dp2_varlen"]
    assert rel_diff(result["losses"], reference["losses"]) <= REL_TOL
    assert_same_training(result, reference)
    assert all(r["dp2_varlen"]["losses"] == result["losses"] for r in dp2_sp2)


def test_each_sample_is_counted_once(sp2, dp2_sp2):
    varlen = sp2[0]["varlen"]
    assert varlen["num_training_batches"] == 4 and varlen["estimated_stepping_batches"] == 4
    assert varlen["throughput_world_sizes"] == [1]  # dp, not the 2 processes
    assert sp2[0]["accumulate"]["estimated_stepping_batches"] == 4
    dp = dp2_sp2[0]["dp2_varlen"]
    assert dp["num_training_batches"] == 4 and dp["throughput_world_sizes"] == [2]

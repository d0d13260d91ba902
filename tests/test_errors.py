"""Bad configurations fail before any compute, with a message naming what to change.

Pure checks of ``validate_sp_size`` / ``refusals.validate_model`` / the strategy's constructor, then one launch of 2 real
processes that runs every bad configuration through ``trainer.fit`` and ends with a good fit in the same processes.
"""

from __future__ import annotations

import pytest

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models import refusals
from lightning_ulysses.parallel.layout import validate_sp_size
from tests.support.launcher import launch
from tests.support.models import build_llama, tiny_llama_config


# ----------------------------------------------------------------------------------------------- sp_size vs world
@pytest.mark.parametrize("sp_size, world_size", [(1, 1), (1, 4), (2, 2), (2, 4), (4, 4), (3, 6), (2, 8)])
def test_valid_sp_sizes_pass(sp_size, world_size):
    validate_sp_size(sp_size, world_size)


def test_world_size_not_divisible_by_sp_size():
    with pytest.raises(ValueError) as err:
        validate_sp_size(3, 4)
    message = str(err.value)
    assert "world size (4 processes) is not divisible by `sp_size=3`" in message
    assert "Choose `sp_size` from [1, 2, 4]" in message
    assert "multiple of 3" in message

    with pytest.raises(ValueError, match=r"Choose `sp_size` from \[1, 2, 3, 6\]"):
        validate_sp_size(4, 6)


def test_sp_size_larger_than_world_size():
    with pytest.raises(ValueError) as err:
        validate_sp_size(3, 2)
    message = str(err.value)
    assert "`sp_size=3` is larger than the world size (2 processes" in message
    assert "Lower `sp_size` to at most 2" in message


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True, None])
def test_invalid_sp_size_values_pure(bad):
    with pytest.raises(ValueError, match="`sp_size` must be a positive integer, got " + repr(bad).replace(".", r"\.")):
        validate_sp_size(bad, 4)


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_invalid_sp_size_rejected_at_construction(bad):
    with pytest.raises(ValueError, match="`sp_size` must be a positive integer"):
        UlyssesDeepSpeedStrategy(sp_size=bad)


def test_valid_sp_size_accepted_at_construction():
    assert UlyssesDeepSpeedStrategy(sp_size=2).sp_size == 2
    assert UlyssesDeepSpeedStrategy(sp_size=16).sp_size == 16  # the world size is checked only once it is known


# ----------------------------------------------------------------------------------------------- the model
def model(**config):
    return build_llama(tiny_llama_config(layers=1, **config))


def test_supported_models_pass():
    validate = refusals.validate_model
    validate(model(), 2, "cpu")
    validate(model(), 4, "cpu")
    validate(model(num_heads=4, num_kv_heads=2), 4, "cpu")  # KV heads replicated
    validate(model(num_heads=4, num_kv_heads=1), 2, "cpu")  # MQA
    validate(model(num_heads=6, num_kv_heads=3), 3, "cpu")
    validate(model(num_heads=6, num_kv_heads=3), 6, "cpu")
    validate(model(num_heads=3, num_kv_heads=3), 1, "cpu")
    validate(model(attn="flex_attention"), 2, "cuda")  # flex is refused on CPU only


def test_fewer_heads_than_sp_ranks():
    with pytest.raises(ValueError) as err:
        refusals.validate_model(model(num_heads=1, num_kv_heads=1), 2, "cpu")
    message = str(err.value)
    assert "num_attention_heads=1, fewer than sp_size=2" in message and "Use sp_size <= 1" in message


def test_uneven_head_counts_are_accepted():
    # split unevenly (issue 5): 3 heads over 2 ranks, 6 heads over 4, GQA 6/3 over 2 and 4
    refusals.validate_model(model(num_heads=3, num_kv_heads=3), 2, "cpu")
    refusals.validate_model(model(num_heads=6, num_kv_heads=6), 4, "cpu")
    refusals.validate_model(model(num_heads=6, num_kv_heads=3), 2, "cpu")
    refusals.validate_model(model(num_heads=6, num_kv_heads=3), 4, "cpu")


def test_query_heads_must_group_evenly_over_kv_heads():
    with pytest.raises(ValueError) as err:
        refusals.validate_model(model(num_heads=6, num_kv_heads=4), 2, "cpu")
    assert "num_attention_heads=6 not divisible by num_key_value_heads=4" in str(err.value)


def test_eager_attention_is_refused():
    with pytest.raises(ValueError) as err:
        refusals.validate_model(model(attn="eager"), 2, "cpu")
    message = str(err.value)
    assert "attn_implementation='eager'" in message
    assert "attn_implementation='sdpa'" in message


def test_flex_attention_on_cpu_is_refused():
    with pytest.raises(ValueError) as err:
        refusals.validate_model(model(attn="flex_attention"), 2, "cpu")
    message = str(err.value)
    assert "flex_attention" in message and "Use attn_implementation='sdpa' on CPU" in message


def test_already_prepared_model_is_validated_by_its_inner_implementation():
    m = model(attn="eager")
    m.config._attn_implementation = "ulysses_eager"
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        refusals.validate_model(m, 2, "cpu")


# ----------------------------------------------------------------------------------------------- through a Trainer
CASES = [
    # (name, sp_size, config overrides)
    ("sp_larger_than_world", 3, {}),
    ("too_few_heads", 2, {"num_heads": 1, "num_kv_heads": 1}),
    ("kv_heads", 2, {"num_heads": 6, "num_kv_heads": 4}),
    ("eager", 2, {"attn": "eager"}),
    ("flex_attention_cpu", 2, {"attn": "flex_attention"}),
    ("sp_larger_than_world_again", 3, {}),  # now with the process group already up
    ("good", 2, {}),
    ("heads_after_good", 2, {"num_heads": 1, "num_kv_heads": 1}),
    ("good_again", 2, {}),
]

EXPECTED_ERRORS = {
    "sp_larger_than_world": ["`sp_size=3` is larger than the world size (2 processes", "Lower `sp_size` to at most 2"],
    "too_few_heads": ["num_attention_heads=1, fewer than sp_size=2", "Use sp_size <= 1"],
    "kv_heads": ["num_attention_heads=6 not divisible by num_key_value_heads=4"],
    "eager": ["attn_implementation='eager'", "attn_implementation='sdpa'"],
    "flex_attention_cpu": ["flex_attention", "Use attn_implementation='sdpa' on CPU"],
    "sp_larger_than_world_again": ["`sp_size=3` is larger than the world size (2 processes"],
    "heads_after_good": ["num_attention_heads=1, fewer than sp_size=2"],
}


@pytest.fixture(scope="module")
def trainer_results():
    cases = [{"name": name, "sp_size": sp, "config": config} for name, sp, config in CASES]
    return launch(2, "errors:run", {"cases": cases}, timeout=300)


@pytest.mark.parametrize("name", list(EXPECTED_ERRORS))
def test_fit_fails_before_any_compute(trainer_results, name):
    for rank, results in enumerate(trainer_results):
        result = results[name]
        assert result["error_type"] == "ValueError", (rank, result)
        for fragment in EXPECTED_ERRORS[name]:
            assert fragment in result["message"], (rank, fragment, result["message"])
        assert result["steps"] == 0 and result["forwards"] == 0, (rank, result)
        assert result["global_step"] == 0
        # the failed fit left the model as the user built it
        assert not result["prepared_after"]
        assert result["attn_after"] == result["attn_before"]


@pytest.mark.parametrize("name", ["good", "good_again"])
def test_fit_after_failed_fits_still_works(trainer_results, name):
    for rank, results in enumerate(trainer_results):
        result = results[name]
        assert result["error_type"] is None, (rank, result["message"])
        assert result["steps"] == 2 and result["global_step"] == 2
        # the steps' only: the model-form check's probes (whole and sharded, twice) do not run the user's hooks
        assert result["forwards"] == 2
        assert len(result["losses"]) == 2 and all(0 < loss < 100 for loss in result["losses"])
        assert not result["prepared_after"] and result["attn_after"] == "sdpa"
        assert result["pg_initialized"]
    # the SP loss is the full-sequence loss: the same on both ranks of the SP group
    assert trainer_results[0][name]["losses"] == trainer_results[1][name]["losses"]
    # the same fresh model and data, so the good fits before and after the other failures agree
    if name == "good_again":
        for results in trainer_results:
            assert results["good_again"]["losses"] == pytest.approx(results["good"]["losses"], rel=1e-5)

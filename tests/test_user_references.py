"""Nothing a user holds is changed behind their back (issue 61): forward hooks on the projections that keep their
outputs, an attention subclass that stores its query on itself and in a dict of a tuple, through fit, validate, test
and predict, with and without ``offload_attention`` and the ALST switches (2 ranks, sp 2), against the same run
without the switches and against one device (plain Lightning)."""

from __future__ import annotations

import pytest
import torch

from tests.scenarios import user_references as scenario
from tests.support.launcher import launch

CHUNK = 8  # offload_attention's positions per chunk: a 32-position row in 4 chunks
ALST = {"offload_attention": CHUNK, "tiled_mlp": 2, "offload_checkpoints": True}
SETTINGS = {
    "plain": {"stage": 2},
    "alst": {"stage": 2, **ALST},
    "alst zero3": {"stage": 3, **ALST, "config": {"stage3_param_persistence_threshold": 0}},
}


@pytest.fixture(scope="module")
def held():
    by_rank = launch(2, "user_references:run", {"settings": SETTINGS}, timeout=400)
    return by_rank, {"plain": scenario.one_device(False), "checkpointed": scenario.one_device(True)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", ["alst", "alst zero3"])
@pytest.mark.parametrize("phase", scenario.PHASES)
def test_what_the_users_code_holds_is_what_it_holds_without_the_switches(held, setting, phase):
    by_rank, _ = held
    for rank in by_rank:
        plain, switched = rank["plain"][phase], rank[setting][phase]
        # forward entries (the recompute of a checkpointed layer runs the hooks again inside backward: checked below)
        forward = [(name, t) for name, in_backward, t in switched["kept"] if not in_backward]
        assert [name for name, _ in forward] == [name for name, _, _ in plain["kept"]]
        for (name, got), (_, _, expected) in zip(forward, plain["kept"]):
            assert _close(got, expected), (phase, name, (got - expected).abs().max())
        for what in ("query_on_module", "query_in_dict", "key_in_dict"):
            assert _close(switched[what], plain[what]), (phase, what)
        recomputed = [(name, t) for name, in_backward, t in switched["kept"] if in_backward]
        if phase == "fit":  # each recomputed output is the one its first forward made, every one still intact
            firsts = {}
            for name, t in forward:
                firsts.setdefault(name, []).append(t)
            assert recomputed and all(any(torch.equal(t, f) for f in firsts[name]) for name, t in recomputed)
        else:
            assert recomputed == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_hooks_are_called_as_often_as_on_one_device(held, setting):
    by_rank, one_device = held
    checkpointed = "offload_checkpoints" in SETTINGS[setting]
    reference = one_device["checkpointed" if checkpointed else "plain"]
    for rank in by_rank:
        got = {phase: rank[setting][phase]["calls"] for phase in scenario.PHASES}
        assert got == {phase: reference[phase]["calls"] for phase in scenario.PHASES}, (setting, got)
        assert all(got[phase] > 0 for phase in scenario.PHASES)
    if setting != "plain":  # the plain layer's block was the strategy's own (the subclass's was not)
        assert all(rank[setting]["owned_attention_calls"] > 0 for rank in by_rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase", ["validate", "test", "predict"])
def test_the_kept_outputs_are_this_ranks_part_of_one_devices(held, phase):
    """Outside fit the weights are one trained state: each rank's kept projection outputs are its positions of what
    one device's hooks kept (fp32, 1e-5)."""
    by_rank, one_device = held
    whole = one_device["plain"][phase]["kept"]
    for rank in by_rank:
        for setting in SETTINGS:
            for (name, _, got), (name1, _, expected) in zip(rank[setting][phase]["kept"], whole):
                assert name == name1
                assert _close(got, scenario.shard_of(expected, rank[setting]["sp_rank"])), (setting, phase, name)

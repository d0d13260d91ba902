"""Each sequence-mixer family module (``lightning_ulysses/families/mixers``) claims the mixers of its own family and
no other's, and its head slicing gives every rank of an SP group its share of the heads (channels) once. Built
in-process from small configs; the exchange these slicings drive is proven against one device in
``tests/test_architectures.py``."""

from __future__ import annotations

import pytest

from lightning_ulysses.families.mixers import FAMILIES
from lightning_ulysses.families.mixers.gated_delta_net import gated_delta_net_slicing
from lightning_ulysses.families.mixers.kimi_delta import kimi_delta_slicing
from lightning_ulysses.families.mixers.lightning_attention import lightning_attention_slicing
from lightning_ulysses.families.mixers.mamba1 import mamba1_slicing
from lightning_ulysses.families.mixers.mamba2 import mamba2_slicing
from lightning_ulysses.families.mixers.short_convolution import short_convolution_slicing
from lightning_ulysses.models.refusals import sequence_mixers
from tests.support.architectures import build_model

# an architecture per family, and the recipe that must claim its mixers
OWN_FAMILY = {"qwen3_5_text": gated_delta_net_slicing, "kimi_linear": kimi_delta_slicing, "mamba2": mamba2_slicing,
              "mamba": mamba1_slicing, "minimax": lightning_attention_slicing, "lfm2": short_convolution_slicing}


@pytest.fixture(scope="module")
def mixers() -> dict[str, list]:
    return {name: sequence_mixers(build_model(name)) for name in OWN_FAMILY}


def test_every_family_module_is_registered():
    assert set(OWN_FAMILY.values()) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(OWN_FAMILY))
def test_a_family_claims_its_own_mixers_and_no_other(mixers, name):
    assert mixers[name], f"{name}: no sequence mixer found"
    for mixer in mixers[name]:
        claimed = [recipe.__name__ for recipe in FAMILIES if recipe(mixer, 0, 2, None) is not None]
        assert claimed == [OWN_FAMILY[name].__name__], (name, type(mixer).__name__, claimed)


@pytest.mark.parametrize("name", sorted(OWN_FAMILY))
def test_two_ranks_split_the_channels_and_together_hold_all(mixers, name):
    """Each rank holds a part of every sliced weight (its heads' channels; channels shared by all heads, such as a
    single group's B and C, on both), and the two together hold every channel."""
    mixer = mixers[name][0]
    slicings = [OWN_FAMILY[name](mixer, rank, 2, None) for rank in range(2)]
    assert all(slicing is not None for slicing in slicings)
    for channel in slicings[0].channels:
        held = [{int(i) for i in slicing.channels[channel]} for slicing in slicings]
        everything = held[0] | held[1]
        assert everything == set(range(len(everything))), (name, channel)
        assert held[0] != everything and held[1] != everything, (name, channel, "not split")

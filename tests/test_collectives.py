"""The communication cost of Ulysses attention, counted with PyTorch's CommDebugMode on real gloo processes and pinned:
per attention layer, one all-to-all for q/k/v (packed) and one for the output in forward, the same two in backward;
one all-reduce per step for the loss (sum and token count of the SP group)."""

import pytest

from tests.support.launcher import launch

LAYERS = (2, 3)


@pytest.fixture(scope="module")
def counts():
    results = launch(2, "collectives:run", {"layers": list(LAYERS), "kv_heads": 2, "stage": 2})
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("layers", LAYERS)
def test_forward_collectives_per_layer(counts, layers):
    assert counts[layers]["forward"] == {"alltoall_base_": 2 * layers, "allreduce_": 1}


@pytest.mark.parametrize("layers", LAYERS)
def test_backward_all_to_all_per_layer(counts, layers):
    # DeepSpeed's own gradient reduction runs after backward hooks; the exchange's part is the all-to-alls.
    assert counts[layers]["backward"]["alltoall_base_"] == 2 * layers

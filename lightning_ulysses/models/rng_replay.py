"""The random generators' state around code run twice (a tile or a checkpointed layer recomputed in backward): taken
before the first run and replayed for the second, so that dropout draws the masks the forward drew."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch


def rng_states(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The CPU generator's state and, on CUDA, the device's: what a module's dropout draws from."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replayed_rng(device: torch.device, states: tuple[torch.Tensor, Optional[torch.Tensor]]) -> Any:
    """The random generators set to ``states`` inside, and put back as they were after (``torch.utils.checkpoint``'s
    rule): a tile recomputed in backward draws the dropout masks its forward drew, so the gradients are those of the
    loss the forward computed. The tiles run in the forward's order and draw one after another, as there."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1], device)
        yield

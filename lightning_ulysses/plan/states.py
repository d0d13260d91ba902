"""What a rank keeps between steps for the model under DeepSpeed's ZeRO, in bytes, by stage: the parameters, the
float32 master weights and gradient partition of the ZeRO optimizer, and the optimizer's own states. ZeRO partitions
over every rank of the run (the sequence-parallel ranks are data-parallel ranks for ZeRO), so these fall with the
world size, not with ``sp``.

Counts per element (``N`` parameters, ``W`` ranks, ``p`` bytes of the training dtype: 4 in float32, 2 in bf16):

========================  =========================  ====================  =====================
stage                     parameters                 master + gradients    optimizer (Adam)
========================  =========================  ====================  =====================
0                         ``N p``                    ``N (4 + 4)`` if p=2  ``8 N``
1, 2                      ``N p``                    ``8 N / W``           ``8 N / W``
3                         ``N p / W``                ``8 N / W``           ``8 N / W``
========================  =========================  ====================  =====================

DeepSpeed keeps a float32 partition of the weights and of the gradients for its optimizer also when training in
float32 (measured, tests/profiling/test_tensor_memory.py). SGD keeps no state, SGD with momentum ``4 N / W``.
``offload_optimizer`` moves the master weights, gradient partition and optimizer states to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_BYTES = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8}  # float32 state bytes per parameter


@dataclass(frozen=True)
class ModelStates:
    """Per rank, in bytes: ``parameters`` (in the training dtype), ``master_and_gradients`` (the ZeRO optimizer's
    float32 partitions), ``optimizer`` (its states); ``host``: what offloading put in host memory instead."""

    parameters: int
    master_and_gradients: int
    optimizer: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.master_and_gradients + self.optimizer


def model_states(parameters: int, trainable: int, world_size: int, stage: int, param_bytes: int,
                 optimizer: str = "adamw", offload_optimizer: bool = False) -> ModelStates:
    """``parameters``/``trainable``: the model's parameter counts; ``param_bytes``: 4 (float32) or 2 (bf16/fp16)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}, not {optimizer!r}.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}.")
    share = 1 if stage == 0 else world_size
    weights = parameters * param_bytes // (world_size if stage == 3 else 1)
    if stage == 0:
        master = trainable * (8 if param_bytes != 4 else 4)  # fp32 weights (when training in 16 bits) + gradients
    else:
        master = 8 * trainable // share
    states = OPTIMIZER_BYTES[optimizer] * trainable // share
    if offload_optimizer:
        return ModelStates(weights, 0, 0, host=master + states)
    return ModelStates(weights, master, states)

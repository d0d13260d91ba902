"""What a rank keeps between steps for the model under DeepSpeed's ZeRO, in bytes, by stage: the parameters, the
float32 master weights and gradient partition of the ZeRO optimizer, and the optimizer's own states. ZeRO partitions
over every rank of the run (the sequence-parallel ranks are data-parallel ranks for ZeRO), so these fall with the
world size, not with ``sp``.

Counts per element, as measured on this stack (``N`` parameters, ``W`` ranks, ``p`` bytes of the training dtype:
4 in float32, 2 in bf16; ZeRO 3 keeps parameters under ``stage3_param_persistence_threshold`` elements, ``N_small``
of them, whole on every rank):

=========  ======================================  ======================  =====================  ================
stage      parameters                              ZeRO float32 copies     optimizer (Adam)       buffers
=========  ======================================  ======================  =====================  ================
0          ``N p``                                 ``4 N`` if p = 2        ``8 N``                 
1, 2       ``N p``                                 ``4 N / W`` (master)    ``8 N / W``
3          ``N_small p + (N - N_small) p / W``     ``8 N / W`` (master,    ``8 N / W``            one reduce
                                                   gradients)                                     bucket ``p``
=========  ======================================  ======================  =====================  ================

At ZeRO 1 and 2 DeepSpeed keeps a float32 partition of the weights between steps, also when training in float32;
its float32 gradient partition exists only from the end of the backward pass to the optimizer step, after the
step's peak (measured: tests/profiling/test_tensor_memory.py, docs/planning.md). Stage 0 is not measured yet.
SGD keeps no state, SGD with momentum ``4 N / W``. ``offload_optimizer`` moves the float32 copies and the optimizer
states to host memory; ``offload_parameters`` (ZeRO 3's ``offload_param``) moves the partitioned parameters (those
over the persistence threshold) there too: the device keeps the persistent ones and the layers gathered in flight
(modeled from DeepSpeed's design, not measured: on a CPU the host is the device).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_BYTES = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8}  # float32 state bytes per parameter


@dataclass(frozen=True)
class ModelStates:
    """Per rank, in bytes: ``parameters`` (in the training dtype), ``master_and_gradients`` (the ZeRO optimizer's
    float32 partitions), ``optimizer`` (its states), ``buffers`` (ZeRO 3's reduce bucket); ``host``: what offloading
    put in host memory instead."""

    parameters: int
    master_and_gradients: int
    optimizer: int
    host: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.master_and_gradients + self.optimizer + self.buffers


def model_states(numels: tuple[int, ...], trainable: int, world_size: int, stage: int, param_bytes: int,
                 optimizer: str = "adamw", offload_optimizer: bool = False, persistence_threshold: int = 100_000,
                 reduce_bucket_size: int = 200_000_000, offload_parameters: bool = False) -> ModelStates:
    """``numels``: every parameter's element count; ``trainable``: how many of them train; ``param_bytes``: 4
    (float32) or 2 (bf16/fp16); ``persistence_threshold``: ZeRO 3's ``stage3_param_persistence_threshold``
    (Lightning's default 1e5); ``offload_parameters``: ZeRO 3's parameter offload (stage 3 only)."""
    if offload_parameters and stage != 3:
        raise ValueError("offload_parameters is ZeRO 3's offload_param: it needs stage=3.")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}, not {optimizer!r}.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}.")
    parameters = sum(numels)
    share = 1 if stage == 0 else world_size
    buffers = 0
    if stage == 3:
        whole = sum(n for n in numels if n < persistence_threshold)
        weights = whole * param_bytes + (parameters - whole) * param_bytes // world_size
        copies = 8 * trainable // world_size
        buffers = reduce_bucket_size * param_bytes
    else:
        weights = parameters * param_bytes
        copies = 4 * trainable // share if (stage > 0 or param_bytes != 4) else 0
    states = OPTIMIZER_BYTES[optimizer] * trainable // share
    host = 0
    if offload_parameters:
        partitioned = weights - whole * param_bytes
        weights, host = weights - partitioned, partitioned
    if offload_optimizer:
        return ModelStates(weights, 0, 0, host=host + copies + states, buffers=buffers)
    return ModelStates(weights, copies, states, host=host, buffers=buffers)

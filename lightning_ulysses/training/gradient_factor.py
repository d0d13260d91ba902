"""The one owner of the gradient factors that make DeepSpeed's gradient reduction give one device's gradient.

DeepSpeed sums the gradients of all DP × SP ranks and divides the sum by a divisor ``D`` that depends on its
configuration (measured on this stack, pinned by tests/test_parity.py and tests/test_steps.py):

* ``D = dp`` at ZeRO 0, 1 and 2, and at ZeRO 3 with ``reduce_scatter: false``;
* ``D = dp × sp`` at ZeRO 3 with ``reduce_scatter`` (Lightning's default).

The strategy has two kinds of loss, and each gets its factor from :class:`GradientFactors`:

* the **whole loss** a training step returns is back-propagated with ``whole_loss = k · D / (dp · sp)``: a term that is
  the same on every rank (a weight regulariser, an auxiliary loss from global quantities) then trains as on one
  device, where ``k`` is the gradient-accumulation count (Lightning and DeepSpeed each divide the loss by ``k``);
* every **SP loss** (a mean over the tokens of the whole batch, each rank holding a share) then gives its local share's
  gradient the factor ``sp_loss_share = dp · sp`` (times ``k`` when the share is normalised by the whole accumulation
  window's tokens), so that the shares of all ranks add up to the gradient of the global mean.

``D`` is stated here once, from the DeepSpeed config, and :func:`verify_deepspeed_divisor` measures it once per
process and configuration at set-up (a one-step probe on a one-weight model with the run's ZeRO settings and process
groups): a DeepSpeed release that averages differently stops the run at start-up instead of training at a silently
wrong scale.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from lightning_ulysses.parallel.layout import group_rank, group_size


@dataclass(frozen=True)
class GradientFactors:
    """The gradient factors of one run (see the module docstring).

    Attributes:
        dp_size: data-parallel replicas.
        sp_size: ranks per SP group.
        accumulation: gradient-accumulation steps ``k``.
        deepspeed_divisor: ``D``, what DeepSpeed divides the sum of all ranks' gradients by.
    """

    dp_size: int = 1
    sp_size: int = 1
    accumulation: int = 1
    deepspeed_divisor: float = 1.0

    @classmethod
    def for_config(cls, deepspeed_config: Mapping[str, Any], sp_size: int, dp_size: int,
                   accumulation: int = 1) -> "GradientFactors":
        return cls(dp_size, sp_size, accumulation, deepspeed_divisor(deepspeed_config, sp_size, dp_size))

    @property
    def sp_loss_share(self) -> float:
        """Factor on the gradient of an SP loss's local share: ``dp · sp`` (SP losses act as replicated terms)."""
        return float(self.dp_size * self.sp_size)

    @property
    def sequence_share(self) -> float:
        """Factor on the gradient of a per-sequence reduction's local share (a sum over the SP group only: each
        replica scores its own rows): ``sp``. With the whole-loss factor, the SP ranks' gradients add up to one
        device's and the replicas average as DDP's do."""
        return float(self.sp_size)

    @property
    def whole_loss(self) -> float:
        """Factor on the gradient of the whole loss a training step back-propagates: ``k · D / (dp · sp)``."""
        return self.accumulation * self.deepspeed_divisor / (self.dp_size * self.sp_size)

    def sp_loss_share_for(self, window_normalised: bool) -> float:
        """The share factor of an SP loss normalised per micro-batch (``dp · sp``) or by the tokens of the whole
        accumulation window (``k · dp · sp``: the whole loss's factor divides by ``k`` once more, measured)."""
        return self.sp_loss_share * (self.accumulation if window_normalised else 1)


def deepspeed_divisor(deepspeed_config: Mapping[str, Any], sp_size: int, dp_size: int = 1) -> float:
    """``D``: what DeepSpeed divides the sum of all ranks' gradients by: ``dp``, or ``dp × sp`` at ZeRO-3 with
    ``reduce_scatter`` (see the module docstring)."""
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True):
        return float(dp_size * sp_size)
    return float(dp_size)


# ---------------------------------------------------------------------------------------------- the set-up probe
_VERIFIED: set[str] = set()  # probe configurations already measured in this process (one probe per configuration)
_AVERAGING_KEYS = ("prescale_gradients", "gradient_predivide_factor", "communication_data_type")


def probe_config(deepspeed_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's settings that decide how DeepSpeed averages gradients, on an fp32 one-weight model (offloading left
    out: it moves where the optimizer runs, not how gradients are averaged)."""
    zero = {k: v for k, v in (deepspeed_config.get("zero_optimization") or {}).items() if not k.startswith("offload")}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                              "zero_allow_untested_optimizer": True, "zero_optimization": zero,
                              "gradient_clipping": 0.0}  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
    config.update({k: deepspeed_config[k] for k in _AVERAGING_KEYS if k in deepspeed_config})
    return config


def measure_deepspeed_divisor(deepspeed_config: Mapping[str, Any], mpu: Any, device: torch.device,
                              device_rank: int) -> float:
    """One SGD step (lr 1) of a one-weight model under DeepSpeed with the run's ZeRO settings and process groups,
    every rank back-propagating gradient ``rank + 1``: the weight moves by ``-sum(rank + 1) / D``, which gives the
    ``D`` DeepSpeed applied. Every rank of the world must call it."""
    import deepspeed

    model = torch.nn.Linear(1, 1, bias=False).to(device)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=device_rank), model=model,
                                      optimizer=optimizer, config=probe_config(deepspeed_config),
                                      dist_init_required=False, mpu=mpu)
    rank, world = group_rank(), group_size()
    value = torch.full((1, 1), float(rank + 1), device=device)
    loss = engine(value).sum()  # gradient on the weight: rank + 1
    engine.backward(loss)
    engine.step()
    zero3 = (deepspeed_config.get("zero_optimization") or {}).get("stage", 0) == 3
    with deepspeed.zero.GatheredParameters([engine.module.weight], enabled=zero3):
        moved = float(engine.module.weight.detach().double().sum())
    engine.destroy()
    summed = world * (world + 1) / 2
    return float("inf") if moved == 0 else -summed / moved


def verify_deepspeed_divisor(factors: GradientFactors, deepspeed_config: Mapping[str, Any], mpu: Any,
                             device: torch.device, device_rank: int) -> None:
    """Measure ``D`` (:func:`measure_deepspeed_divisor`, once per process and configuration) and raise if it is not
    the divisor the strategy's gradient factors assume."""
    key = json.dumps([probe_config(deepspeed_config), factors.dp_size, factors.sp_size, group_size()],
                     sort_keys=True, default=str)
    if key in _VERIFIED:
        return
    measured = measure_deepspeed_divisor(deepspeed_config, mpu, device, device_rank)
    if abs(measured - factors.deepspeed_divisor) > 1e-6 * factors.deepspeed_divisor:
        zero = deepspeed_config.get("zero_optimization") or {}
        raise RuntimeError(divisor_mismatch_error(measured, factors, zero))
    _VERIFIED.add(key)


def divisor_mismatch_error(measured: float, factors: GradientFactors, zero: Mapping[str, Any]) -> str:
    import deepspeed

    return (
        f"UlyssesDeepSpeedStrategy: DeepSpeed {deepspeed.__version__} divides the sum of the ranks' gradients by"
        f" {measured:g} (measured at set-up by a one-step probe), while the strategy's gradient factors assume"
        f" {factors.deepspeed_divisor:g} for ZeRO stage {zero.get('stage', 0)}"
        f" (reduce_scatter={zero.get('reduce_scatter', True)}) with dp={factors.dp_size}, sp={factors.sp_size}."
        " Training would run at a silently wrong gradient scale, so it stops before any step. This DeepSpeed"
        " version averages gradients differently from the ones the strategy was measured on"
        " (lightning_ulysses/training/gradient_factor.py): pin a tested DeepSpeed version and please report it."
    )

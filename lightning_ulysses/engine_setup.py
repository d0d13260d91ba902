"""DeepSpeed engine set-up with the SP groups as DeepSpeed's ``mpu``.

Lightning's ``DeepSpeedStrategy._setup_model_and_optimizer`` and ``_initialize_deepspeed_inference`` call
``deepspeed.initialize`` without an ``mpu``; these are their bodies with the one argument added (``mpu``: DeepSpeed
then takes the data-parallel world for its batch arithmetic and reduces gradients over DP×SP) and the device rank
fixed for CPU. This is the one place that must follow Lightning's changes to those private methods:
``tests/test_lifecycle.py::test_engine_setup_follows_lightnings_private_methods`` fails when Lightning's signatures or
the arguments it passes to ``deepspeed.initialize`` change.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Union

from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import override


class DeepSpeedEngineSetup:
    """Mixed into :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy` before Lightning's ``DeepSpeedStrategy``."""

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optional[Optimizer],
        lr_scheduler: Optional[Union[LRScheduler, ReduceLROnPlateau]] = None,
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            mpu=self.layout.deepspeed_mpu(),
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self._reinstall_model_hooks()  # the strategy's own pre-hooks went with Lightning's clean-up
        self.model, _, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
            mpu=self.layout.deepspeed_mpu(),
        )

    def _deepspeed_args(self) -> argparse.Namespace:
        # Lightning passes root_device.index, which is None on CPU and breaks DeepSpeed's rank arithmetic.
        index = self.root_device.index
        return argparse.Namespace(device_rank=self.local_rank if index is None else index)


def use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed run on CPU when Lightning does, even on a machine whose CUDA DeepSpeed would pick."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())

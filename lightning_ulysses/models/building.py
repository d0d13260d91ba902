"""Building and handing over Hugging Face models the way fine-tuning users do.

* **ZeRO-3 building.** Lightning builds models in ``configure_model`` inside DeepSpeed's ``zero.Init``, which
  partitions every parameter as its module is created. Transformers then initialises and loads weights into
  parameters that hold nothing (``IndexError`` in ``_init_weights``), unless it knows ZeRO-3 is active: its DeepSpeed
  integration reads that from a process-global weak reference to an ``HfDeepSpeedConfig``.
  :func:`transformers_zero3_aware` keeps one alive only while the model is built, so ``from_pretrained`` loads the
  file's weights into the partitions (rank 0 reads the file, the others receive) and ``from_config`` initialises
  through gathered parameters; afterwards the previous global state is back.
* **Initialisation after construction.** Code that initialises parameters *after* their module was built (PEFT's LoRA
  layers: ``nn.init.zeros_(lora_B.weight)`` once ``lora_B`` exists) writes into an empty ZeRO-3 partition: the call
  does nothing and ``lora_B`` keeps ``nn.Linear``'s random default instead of zeros: training starts from a model
  that is no longer the pretrained one, with no error. :func:`partition_aware_init` makes ``torch.nn.init``'s in-place
  functions gather a partitioned parameter, initialise it (on every rank, so the random streams advance as in a plain
  process) and partition rank 0's result again.
* **Train mode.** ``from_pretrained`` returns a model in eval mode and Lightning (>= 2.2) keeps submodule modes, so
  inside ``fit`` such a model would silently run without gradient checkpointing and without dropout.
  :func:`switch_to_train_mode` puts a model whose root is in eval mode into train mode for ``fit``;
  :func:`restore_modes` puts every module back afterwards.
"""

from __future__ import annotations

import copy
import functools
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.patches import replaced


@contextmanager
def transformers_zero3_aware(ds_config: dict[str, Any]) -> Iterator[None]:
    """Within the block, transformers treats ZeRO-3 as active (``is_deepspeed_zero3_enabled()`` is true) with
    ``ds_config``; on exit the previous process-global state is restored (nothing stays behind)."""
    with _compat.transformers_deepspeed_config(copy.deepcopy(ds_config)):
        yield


# The in-place initialisers of torch.nn.init (each takes the tensor first).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


def _is_partitioned(tensor: Any) -> bool:
    return _compat.is_zero3_released(tensor)


def _gathering(init_function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init_function)
    def init_partitioned(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _is_partitioned(tensor):
            return init_function(tensor, *args, **kwargs)
        import deepspeed

        # Every rank gathers the full tensor and runs the initialiser (same random draws as a plain process);
        # on exit rank 0's values are partitioned again (a collective: every rank runs the same build code).
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
            init_function(tensor, *args, **kwargs)
        return tensor

    init_partitioned.__wrapped_by_ulysses__ = True  # type: ignore[attr-defined]
    return init_partitioned


@contextmanager
def partition_aware_init() -> Iterator[None]:
    """Within the block, ``torch.nn.init.<fn>_(param, ...)`` on a ZeRO-3-partitioned parameter initialises the whole
    parameter (gathered) instead of silently doing nothing; other tensors are unaffected. Restored on exit."""
    with ExitStack() as stack:
        for name in _INIT_FUNCTIONS:
            function = getattr(nn.init, name, None)
            if function is not None and not getattr(function, "__wrapped_by_ulysses__", False):
                stack.enter_context(replaced(nn.init, name, _gathering(function), f"torch.nn.init.{name}"))
        yield


ModuleModes = list[tuple[nn.Module, bool]]


def switch_to_train_mode(model: nn.Module) -> ModuleModes:
    """If ``model`` itself is in eval mode (as ``from_pretrained`` returns it), switch it and all its submodules to
    train mode and return every module's previous mode; a model whose root is in train mode is left as the user set
    it (submodules deliberately in eval mode stay so). Undo with :func:`restore_modes`."""
    if model.training:
        return []
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    return modes


def restore_modes(modes: ModuleModes) -> None:
    for module, training in modes:
        module.training = training


def train_mode_for_fit(models: list[nn.Module]) -> ModuleModes:
    """``from_pretrained`` returns models in eval mode and Lightning keeps submodule modes: without this, fit would
    silently run such a model without gradient checkpointing and dropout. Returns the modes to give back after fit
    (:func:`restore_modes`)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    saved: ModuleModes = []
    for model in models:
        modes = switch_to_train_mode(model)
        if modes:
            rank_zero_info(
                f"UlyssesDeepSpeedStrategy: {type(model).__name__} was in eval mode (as `from_pretrained` returns"
                " models); it trains in train mode (dropout, gradient checkpointing on) and gets its modes back"
                " after fit. To keep parts frozen in eval mode, call `.eval()` on those submodules only."
            )
        saved.extend(modes)
    return saved

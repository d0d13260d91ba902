"""The sequence-parallel settings of a strategy, as one frozen object: both front ends (the Trainer's and Fabric's
``UlyssesDeepSpeedStrategy``) build it from their keyword arguments, it validates every value once, when the strategy
is made, and nothing changes it afterwards. The sizes that depend on the world (the resolved ``sp_size``, dp, the
groups) belong to the layout (:class:`~lightning_ulysses.parallel.layout.SequenceParallelLayout`), built from this
object once the processes exist.

The front ends keep their keyword arguments (what a user, an IDE and the Lightning CLI read);
``tests/test_config.py`` checks that both declare exactly these fields with these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_ulysses.models.memory import MemoryFeatures, TileSetting
from lightning_ulysses.parallel.attention import ModuleSelector
from lightning_ulysses.parallel.layout import validate_ring_size, validate_sp_size
from lightning_ulysses.plan.auto import AUTO
from lightning_ulysses.parallel.offload_attention import chunk_length
from lightning_ulysses.plan.preflight import MODES as PREFLIGHT_MODES


@dataclass(frozen=True)
class SequenceParallelConfig:
    """Every sequence-parallel setting of a strategy (see the front ends' docstrings for each argument).

    Attributes:
        sp_size: ranks per SP group as requested; ``None``: every device of a node (resolved by :meth:`sp_size_for`);
            ``"auto"``: chosen from the memory plan once the model is known (:mod:`lightning_ulysses.plan.auto`).
        sequence_length: the tokens per row the run trains on, for ``sp_size="auto"``.
        ring_size: ring groups per SP group (hybrid Ulysses × ring); 1: Ulysses only.
        sdpa_per_document: with ``sdpa``, attend within each packed document by one call per document.
        attention_modules: attention cores of the user's own model to wrap (selectors).
        tiled_mlp, tiled_loss, offload_checkpoints: the ALST memory switches (:attr:`memory_features`).
        offload_attention: attention over chunks of the gathered sequence, the chunks not in use in host memory
            (Ulysses-Offload): ``True``/``"auto"``, positions per chunk, or ``False``.
        check_sp_agreement, verify_checkpoints, check_model_form: the checks before compute and of checkpoints.
        allow_untested_versions: an untested library version warns instead of stopping.
        memory_budget: bytes per rank for the pre-flight check; ``None``: the device's free memory.
        preflight: ``"stop"``, ``"warn"`` or ``"off"``.
        gather_predictions: per-token ``predict_step`` outputs gathered to whole rows (the Trainer only).
    """

    sp_size: Optional[Union[int, str]] = None
    sequence_length: Optional[int] = None
    ring_size: int = 1
    sdpa_per_document: bool = False
    attention_modules: tuple[ModuleSelector, ...] = ()
    tiled_mlp: TileSetting = 0
    tiled_loss: TileSetting = 0
    offload_checkpoints: bool = False
    offload_attention: Union[bool, int, str] = False
    check_sp_agreement: bool = True
    verify_checkpoints: bool = True
    check_model_form: bool = True
    allow_untested_versions: bool = False
    memory_budget: Optional[int] = None
    preflight: str = "stop"
    gather_predictions: bool = True

    def __post_init__(self) -> None:
        length = self.sequence_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(f"sequence_length must be a positive number of tokens per row, not {length!r}.")
        if self.auto:
            if length is None:
                raise ValueError("sp_size='auto' chooses the size from the memory plan of a row of the run's length:"
                                 " pass `sequence_length=<tokens per row>` too.")
            if self.ring_size != 1:
                raise ValueError("sp_size='auto' chooses a Ulysses size only (a ring is chosen by hand; the planner"
                                 " plans one: python -m lightning_ulysses.plan --ring): pass both sizes as numbers,"
                                 " or ring_size=1.")
        elif isinstance(self.sp_size, str):
            raise ValueError(f"`sp_size` must be a positive integer, None or 'auto', got {self.sp_size!r}.")
        elif self.sp_size is not None:
            validate_sp_size(self.sp_size, self.sp_size)  # type and sign; the world size is checked once known
        if not self.auto:
            validate_ring_size(self.ring_size, self.sp_size if self.sp_size is not None else self.ring_size)
        object.__setattr__(self, "attention_modules", tuple(self.attention_modules or ()))
        MemoryFeatures(self.tiled_mlp, self.tiled_loss, self.offload_checkpoints)  # raises naming the bad value
        chunk_length(self.offload_attention)  # raises naming the bad value
        if chunk_length(self.offload_attention) is not None and self.ring_size != 1:
            raise ValueError("offload_attention with ring_size > 1 is not supported yet (the chunks would have to"
                             " run inside each ring step): use one of them.")
        if self.preflight not in PREFLIGHT_MODES:
            raise ValueError(f"preflight must be one of {PREFLIGHT_MODES}, not {self.preflight!r}.")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes per rank, not {budget!r}.")

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> "SequenceParallelConfig":
        """The config of a front end's constructor arguments (its ``locals()``: the fields are picked by name)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})

    @property
    def memory_features(self) -> MemoryFeatures:
        """The ALST memory switches."""
        return MemoryFeatures(self.tiled_mlp, self.tiled_loss, self.offload_checkpoints,
                              ulysses_offload=self.attention_chunk is not None)

    @property
    def attention_chunk(self) -> Optional[int]:
        """Positions per chunk of the offloaded attention (``None``: off)."""
        return chunk_length(self.offload_attention)

    @property
    def auto(self) -> bool:
        """Whether the SP size is chosen from the memory plan (``sp_size="auto"``)."""
        return isinstance(self.sp_size, str) and self.sp_size == AUTO

    def sp_size_for(self, devices_per_node: int) -> int:
        """The SP group size: as requested, or every device of a node for ``sp_size=None``."""
        if self.auto:
            raise RuntimeError("sp_size='auto' is chosen once the model is known (the Trainer: before DeepSpeed's"
                               " engine is built; Fabric: at fabric.setup(model)); the size does not exist before.")
        return self.sp_size if self.sp_size is not None else devices_per_node


def front_end_arguments() -> Sequence[str]:
    """The keyword arguments both front ends declare (Fabric's leaves out ``gather_predictions``)."""
    return [f.name for f in fields(SequenceParallelConfig)]

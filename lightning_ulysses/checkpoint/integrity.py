"""Trustworthy checkpoint files: content digests in the completion marker, and loading without running pickled code.

* **Digests.** After every rank has written its ZeRO shard, the files of the checkpoint are hashed (SHA-256), each
  rank hashing its share in parallel (:func:`share_of`), and rank 0 records every file's size and digest in the
  marker. Resume and :func:`~lightning_ulysses.export_checkpoint` re-hash and refuse a file whose bytes changed
  (a same-size corruption passes a size check: measured, a loss jump of 8.7% or NaN after resuming).
* **Restricted unpickling.** :func:`restricted_torch_load` makes every ``torch.load`` inside it (ours and DeepSpeed's
  ``zero_to_fp32``) run with ``weights_only=True``, allowing only the classes that DeepSpeed's and Lightning's
  checkpoint files contain, so a checkpoint from elsewhere cannot run pickled code when it is exported. Export does
  import the Hugging Face model class whose dotted path the strategy recorded in the checkpoint (a class of an
  installed package, e.g. ``transformers....LlamaForCausalLM``), as ``from_pretrained`` of a local config would.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from lightning_ulysses.patches import replaced


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def share_of(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` hashes: every ``world_size``-th of the sorted names, starting at ``rank``."""
    return sorted(names)[rank::world_size]


def digests(directory: Path, names: Sequence[str]) -> dict[str, str]:
    return {name: file_digest(directory / name) for name in names}


def mismatches(directory: Path, expected: dict[str, Any], names: Sequence[str]) -> list[str]:
    """Which of ``names`` have bytes other than the marker recorded (``expected``: name -> {"sha256": ...})."""
    wrong = []
    for name in names:
        record = expected.get(name)
        want = record.get("sha256") if isinstance(record, dict) else None
        if want is not None and file_digest(directory / name) != want:
            wrong.append(name)
    return wrong


def _allowed_globals() -> list[Any]:
    """Classes DeepSpeed's and Lightning's checkpoint files contain besides tensors and builtins (found by
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on this package's checkpoints at ZeRO 0-3)."""
    import argparse
    import collections
    import pathlib

    allowed: list[Any] = [collections.OrderedDict, collections.defaultdict, argparse.Namespace, pathlib.PosixPath,
                          pathlib.PurePosixPath, set, frozenset]
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        allowed.append(ZeroStageEnum)
    except ImportError:
        pass
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        allowed += [LossScaler, DynamicLossScaler]
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed.append(fragment_address)
    except ImportError:
        pass
    try:
        from lightning.fabric.utilities.data import AttributeDict

        allowed.append(AttributeDict)
    except ImportError:
        pass
    return allowed


@contextmanager
def restricted_torch_load() -> Iterator[None]:
    """Every ``torch.load`` inside runs with ``weights_only=True`` and the allow-list above (also where a library
    asks for ``weights_only=False``). A file needing any other class raises ``pickle.UnpicklingError`` naming it."""
    original = torch.load
    allowed = _allowed_globals()

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return original(*args, **kwargs)

    with replaced(torch, "load", load, "torch.load"):
        yield

"""The digest of a full batch that SP peers compare before every step (:mod:`lightning_ulysses.training.agreement`),
taken by the collate step before it cuts the shard."""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

_MASK = (1 << 62) - 1  # fingerprints are non-negative and below 2**62, so -fingerprint fits in int64


def batch_fingerprint(batch: Mapping[str, Any]) -> int:
    """A 62-bit digest (BLAKE2b) of every tensor of a full batch: its key, dtype, shape and bytes. Two batches that
    differ in any element, order, length or dtype get different fingerprints (up to a 2**-62 chance)."""
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)):
        value: torch.Tensor = batch[key]
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        data = value.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        if data.dtype == torch.bool:
            data = data.to(torch.uint8)
        digest.update(data.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") & _MASK

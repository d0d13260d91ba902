"""The sequence-parallel attention of Hugging Face models chooses how to attend over the whole sequence from a
declared :class:`~lightning_ulysses.models.hf_attention.AttentionSpec` by one table (``ATTENTION_PATHS``), first
match wins. The exactness of every path is proven against one device in the parity, window, ring, sink, packing and
vision tests; this pins the choice. In-process."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.models.hf_attention import ATTENTION_PATHS, AttentionSpec, attention_path

PACKED = ShardInfo.__new__(ShardInfo)


@pytest.mark.parametrize("spec, seq_len, path", [
    (AttentionSpec("sdpa"), 64, "sdpa"),
    (AttentionSpec("sdpa", window=8), 64, "sdpa"),  # the banded SDPA
    (AttentionSpec("flex_attention", window=8), 64, "flex"),
    (AttentionSpec("flash_attention_2", window=8), 64, "kernel"),  # flash applies its window itself
    (AttentionSpec("sdpa", documents=PACKED), 64, "documents"),
    (AttentionSpec("flash_attention_2", documents=PACKED), 64, "documents"),
    (AttentionSpec("sdpa", chunk=16), 64, "chunks"),
    (AttentionSpec("sdpa", chunk=64), 64, "sdpa"),  # a chunk as long as the sequence is plain causal attention
    (AttentionSpec("sdpa", chunk=16, documents=PACKED), 64, "chunks"),
    (AttentionSpec("sdpa", ring=True, documents=PACKED, window=8), 64, "ring"),
    (AttentionSpec("eager", sinks=torch.zeros(4), ring=False, window=8), 64, "sinks"),
    (AttentionSpec("sdpa", sinks=torch.zeros(4), ring=True), 64, "sinks"),
    (AttentionSpec("sdpa", offload_chunk=16, documents=PACKED, window=8), 64, "offload"),
])
def test_one_table_chooses_how_to_attend(spec, seq_len, path):
    assert attention_path(spec, seq_len) == path


def test_every_spec_finds_a_path_and_the_table_ends_with_the_kernel_itself():
    assert [name for name, _, _ in ATTENTION_PATHS] == ["sinks", "ring", "offload", "chunks", "documents", "flex",
                                                        "sdpa", "kernel"]
    assert ATTENTION_PATHS[-1][1](AttentionSpec("anything"), 1)

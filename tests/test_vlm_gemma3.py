"""Gemma 3 trains under SP as on one device with images: each image's tokens attend to each other both ways (its
training mask, from ``token_type_ids``), on its full-attention and its sliding-window layers, computed without an
``[S, S]`` mask (:mod:`lightning_ulysses.parallel.image_blocks`).

In-process: the block attention against a dense mask (which equals transformers' own masks), sliding windows and
blocks at both ends of the row, gradients too; the prepared model's whole path at sp=1 against the model's own
forward; refusals. One 2-process launch: SGD, fp32, 4 steps at ZeRO 2 and 3 against plain transformers on one
process, with (a) an image straddling the shard boundary, (b) two images of different sizes, (c) images at both
ends of the row, (d) padded rows, one text-only."""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device

SUPPORT = "tests.support.vision_gemma3"
RUNS = [("gemma3", 2), ("gemma3", 3)]
VISION_PREFIXES = ("model.vision_tower", "model.multi_modal_projector")


# ------------------------------------------------------------------------------------ the block attention, alone
def _token_types() -> torch.Tensor:
    """``[3, 24]``: blocks at the start and the end of rows, one token long, longer than the window, adjacent to
    another block after one text token, and a row without any."""
    types = torch.zeros(3, 24, dtype=torch.long)
    types[0, 0:6] = types[0, 9:11] = types[0, 12:20] = 1
    types[1, 3] = types[1, 18:24] = 1
    return types


def test_blocks_are_the_runs_of_image_tokens_as_transformers_finds_them():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from lightning_ulysses.parallel.image_blocks import ImageBlocks

    types = _token_types()
    blocks = ImageBlocks.from_token_types(types)
    assert blocks.spans == ((0, 0, 6), (0, 9, 11), (0, 12, 20), (1, 3, 4), (1, 18, 24))
    theirs = get_block_sequence_ids_for_mask(types)  # [3, 24] block number per row, -1 on text
    for row, start, end in blocks.spans:
        assert len(set(theirs[row, start:end].tolist())) == 1 and int(theirs[row, start]) >= 0
    assert int((theirs >= 0).sum()) == sum(end - start for _, start, end in blocks.spans)
    assert not ImageBlocks.from_token_types(torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("window", [None, 4])
def test_the_dense_reference_is_transformers_own_mask(window):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (create_masks_for_vision_model,
                                                             get_block_sequence_ids_for_mask)

    from lightning_ulysses.parallel.image_blocks import ImageBlocks, dense_reference_mask

    types = _token_types()
    config = Gemma3TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_hidden_layers=2, sliding_window=window or 4,
                              layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "sdpa"
    B, S = types.shape
    masks = create_masks_for_vision_model(config, torch.zeros(B, S, 32), None, None, torch.arange(S).expand(B, S),
                                          get_block_sequence_ids_for_mask(types))
    theirs = masks["sliding_attention" if window else "full_attention"][:, 0]  # [B, S, S] bool
    assert torch.equal(dense_reference_mask(ImageBlocks.from_token_types(types), B, S, window), theirs)


def _sdpa(q, k, v, mask):  # [B, h, L, D] -> [B, L, h, D]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("window", [None, 4, 7, 30])
def test_block_attention_equals_the_dense_mask_with_gradients(window):
    """Causal (windowed) attention with each block's rows recomputed equals one SDPA call with the dense mask, output
    and gradients of q, k and v (float64; GQA, 4 query heads on 2 KV heads)."""
    from lightning_ulysses.parallel.image_blocks import ImageBlocks, attend_image_blocks, dense_reference_mask
    from lightning_ulysses.parallel.ring import causal_window_mask

    types = _token_types()
    blocks = ImageBlocks.from_token_types(types)
    B, S = types.shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, S, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    positions = torch.arange(S)

    def attend(qb, kb, vb, mask):
        return _sdpa(qb, kb, vb, None if mask is None else mask[None, None])

    causal = _sdpa(q, k, v, causal_window_mask(positions, positions, window))
    ours = attend_image_blocks(attend, q, k, v, causal, blocks, window)
    theirs = _sdpa(q, k, v, dense_reference_mask(blocks, B, S, window)[:, None])
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(theirs)
    mine = torch.autograd.grad((ours * weights).sum(), (q, k, v))
    reference = torch.autograd.grad((theirs * weights).sum(), (q, k, v))
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_without_blocks_the_causal_output_is_returned_as_is():
    from lightning_ulysses.parallel.image_blocks import ImageBlocks, attend_image_blocks

    causal = torch.randn(1, 5, 2, 4)
    assert attend_image_blocks(None, None, None, None, causal, ImageBlocks(())) is causal


# ---------------------------------------------------------------------------- the prepared model, one process
def _context(group, info, ring_size: int = 1, batch_tensors=None):
    from lightning_ulysses.training.step_context import StepContext

    return StepContext(sp_group=group, ulysses_group=group, ring_group=group, ring_size=ring_size, shard_info=info,
                       in_step=True, step_batch_tensors=batch_tensors or {})


def test_the_prepared_model_equals_its_own_forward_with_image_blocks(one_process_group):
    """sp=1 through the whole path (call completion, image rows, blocks to the Ulysses attention): the logits equal
    the model's own forward with transformers' masks, on every batch (the sliding layer's window 8 is shorter than
    an image's 16 tokens); the block path ran for the batches with images."""
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.models import hf_attention
    from lightning_ulysses.models.hf import prepare_model, restore_model
    from tests.support.vision_gemma3 import batches, build_model

    hf_attention.register_attention_functions()
    model = build_model().eval()
    reference = build_model().eval()
    calls = []
    original = hf_attention.attend_image_blocks

    def recorded(*args, **kwargs):
        calls.append(args[5].spans)
        return original(*args, **kwargs)

    hf_attention.attend_image_blocks = recorded
    try:
        for batch in batches():
            shard = shard_batch(batch, 1, 0)
            info = shard.pop("_ulysses")
            context = _context(one_process_group, info, batch_tensors=
                               {key: shard.get(key) for key in ("position_ids", "attention_mask")})
            prepare_model(model, context)
            inputs = {k: v for k, v in shard.items() if k not in ("labels", "shift_labels")}
            with torch.no_grad():
                ours = model(**inputs).logits
                theirs = reference(**{k: v for k, v in batch.items() if k != "labels"}).logits
            restore_model(model)
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
            torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    finally:
        hf_attention.attend_image_blocks = original
    assert len(calls) == 2 * len(batches())  # two layers, every batch has an image
    assert calls[0] == ((0, 12, 28),)


def test_a_text_only_call_gets_no_blocks():
    """Without ``token_type_ids``, or with types that mark no image, the call stays causal as before (no blocks
    handed to the attention)."""
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.parallel.image_blocks import IMAGE_BLOCKS_KWARG
    from lightning_ulysses.families.vision import family_of
    from tests.support.vision_gemma3 import build_model

    model = build_model()
    ids = torch.randint(0, 100, (1, 12))
    for batch in ({"input_ids": ids}, {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}):
        shard = shard_batch(batch, 1, 0)
        info = shard.pop("_ulysses")
        family_of("gemma3").complete_attention(model, shard, info, _context(None, info))
        assert IMAGE_BLOCKS_KWARG not in shard


@pytest.mark.parametrize("case, match", [("ring", "ring_size=2"), ("flex", "'flex_attention'"),
                                         ("packed", "pack several samples"), ("bidirectional", "bidirectionally")])
def test_image_blocks_are_refused_where_they_would_not_be_exact(case, match):
    """Before the forward: ring attention, another attention implementation than sdpa, packed rows and a layer
    that is bidirectional already, each with what to change."""
    from lightning_ulysses import _compat
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.families.vision import family_of
    from tests.support.vision_gemma3 import batches, build_model

    model = build_model()
    batch = dict(batches()[0])
    if case == "packed":
        length = batch["input_ids"].shape[1]
        batch["position_ids"] = torch.cat([torch.arange(30), torch.arange(length - 30)])[None]
    if case == "flex":
        _compat.set_attention_implementation(model.config, "ulysses_flex_attention")
    if case == "bidirectional":
        model.config.text_config.use_bidirectional_attention = True
    shard = shard_batch(batch, 1, 0)
    info = shard.pop("_ulysses")
    context = _context(None, info, ring_size=2 if case == "ring" else 1)
    with pytest.raises(ValueError, match=match) as error:
        family_of("gemma3").complete_attention(model, shard, info, context)
    assert "token_type_ids" in str(error.value)


# ------------------------------------------------------------------------------------- SP training, 2 processes
@pytest.fixture(scope="module")
def trained():
    return launch(2, "vlm_gemma3:run", {"runs": RUNS, "sp_size": 2, "support": SUPPORT})


@pytest.fixture(scope="module")
def reference():
    return train_single_device("gemma3", support=SUPPORT)


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_training_matches_single_device(trained, reference, family, stage):
    from tests.support.vision_gemma3 import build_model

    vision = assert_trains_as_single_device(trained, reference, f"{family}-zero{stage}",
                                            dict(build_model(family).named_parameters()), VISION_PREFIXES)
    assert any(k.startswith("model.vision_tower") for k in vision)


def test_every_step_attends_within_the_whole_batch_blocks(trained):
    """Each step's SP attention calls (both layers, forward) took the block path with the blocks of the whole batch
    on global positions, the same on both ranks: the straddling image's block spans the shard boundary."""
    from lightning_ulysses.parallel.image_blocks import ImageBlocks
    from tests.support.models import lightning_order
    from tests.support.vision import SEED
    from tests.support.vision_gemma3 import batches

    every = batches()
    for rank in trained:
        steps = rank["gemma3-zero2"]["block_calls"]
        for step, index in enumerate(lightning_order(4, SEED)):
            expected = ImageBlocks.from_token_types(every[index]["token_type_ids"]).spans
            assert steps[step] and all(spans == expected for spans in steps[step]), (step, steps[step], expected)
    assert ImageBlocks.from_token_types(every[0]["token_type_ids"]).spans == ((0, 12, 28),)  # shard boundary 19

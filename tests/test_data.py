"""The collate contract (``shard_batch``, ``SequenceShardingCollate``, ``install_sharding_collate``) and the SP loss
helpers, in-process: no process group. Every expected tensor is built by hand here, independently of the library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from lightning_ulysses.data.sharding import SequenceShardingCollate, install_sharding_collate, shard_batch
from lightning_ulysses.training.gradient_factor import deepspeed_divisor
from lightning_ulysses.training.loss import sequence_parallel_cross_entropy

IGNORE = -100
SEQ_KEYS = ("input_ids", "labels", "shift_labels", "position_ids")


def all_shards(batch, sp_size, pad_token_id=0):
    """Every rank's shard, without the ShardInfo the strategy pops (tested on its own below)."""
    shards = [shard_batch(batch, sp_size, r, pad_token_id=pad_token_id) for r in range(sp_size)]
    for shard in shards:
        assert shard.pop("_ulysses").seq_len == batch["input_ids"].shape[1]
    return shards


def concat(shards, key):
    return torch.cat([s[key] for s in shards], dim=1)


def rows(*values):
    return torch.tensor(values, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- shapes & positions
@pytest.mark.parametrize("sp_size", [2, 4])
def test_every_rank_gets_its_slice_with_global_positions(sp_size):
    B, S = 2, 8
    input_ids = torch.arange(1, B * S + 1).view(B, S)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    s = S // sp_size
    for r, shard in enumerate(all_shards(batch, sp_size)):
        assert set(shard) == {"input_ids", "labels", "shift_labels", "position_ids"}
        for key in SEQ_KEYS:
            assert shard[key].shape == (B, s), key
            assert shard[key].is_contiguous()
        assert torch.equal(shard["input_ids"], input_ids[:, r * s:(r + 1) * s])
        # global positions of this slice, the same for every row
        assert shard["position_ids"].dtype == torch.long
        assert torch.equal(shard["position_ids"], torch.arange(r * s, (r + 1) * s).repeat(B, 1))
    full = all_shards(batch, sp_size)
    assert torch.equal(concat(full, "position_ids"), torch.arange(S).repeat(B, 1))
    assert torch.equal(concat(full, "input_ids"), input_ids)


def test_user_position_ids_are_kept_packed_style():
    # two packed rows with restarting positions: the collate must not replace them with 0..S-1
    positions = rows([0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3])
    input_ids = torch.arange(10, 26).view(2, 8)
    batch = {"input_ids": input_ids, "position_ids": positions}
    shards = all_shards(batch, 2)
    assert torch.equal(shards[0]["position_ids"], rows([0, 1, 2, 0], [0, 1, 2, 3]))
    assert torch.equal(shards[1]["position_ids"], rows([1, 0, 1, 2], [0, 1, 2, 3]))
    assert torch.equal(concat(shards, "position_ids"), positions)
    assert "shift_labels" not in shards[0]  # no labels, no shift_labels


def test_user_position_ids_continue_counting_in_padding():
    positions = rows([0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    batch = {"input_ids": torch.arange(1, 11).view(1, 10), "position_ids": positions}
    shards = all_shards(batch, 4)
    assert [tuple(s["position_ids"].shape) for s in shards] == [(1, 3)] * 4
    assert torch.equal(concat(shards, "position_ids"), rows([0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]))


# ----------------------------------------------------------------------------------------------- shift_labels
def test_shift_labels_are_next_token_targets_with_ignore_at_the_end():
    labels = rows([5, 6, IGNORE, 8, 9, 10, 11, 12], [20, 21, 22, 23, IGNORE, IGNORE, 26, 27])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    expected = rows([6, IGNORE, 8, 9, 10, 11, 12, IGNORE], [21, 22, 23, IGNORE, IGNORE, 26, 27, IGNORE])
    for sp in (1, 2, 4):
        shards = all_shards(batch, sp)
        assert torch.equal(concat(shards, "shift_labels"), expected), sp
        assert torch.equal(concat(shards, "labels"), labels), sp  # labels themselves untouched
    # the last rank's shard ends with the ignored position; the first rank's shard's last target crosses the boundary
    shards = all_shards(batch, 2)
    assert torch.equal(shards[0]["shift_labels"], rows([6, IGNORE, 8, 9], [21, 22, 23, IGNORE]))
    assert torch.equal(shards[1]["shift_labels"], rows([10, 11, 12, IGNORE], [IGNORE, 26, 27, IGNORE]))


def test_user_shift_labels_are_kept():
    input_ids = torch.arange(1, 9).view(1, 8)
    mine = rows([7, 7, 7, 7, 7, 7, 7, 7])
    out = all_shards({"input_ids": input_ids, "labels": input_ids.clone(), "shift_labels": mine}, 2)
    assert torch.equal(concat(out, "shift_labels"), mine)


def test_input_batch_is_not_modified():
    input_ids = torch.arange(1, 11).view(1, 10)
    mask = torch.tensor([[1] * 8 + [0] * 2])
    batch = {"input_ids": input_ids, "labels": input_ids.clone(), "attention_mask": mask}
    before = {k: v.clone() for k, v in batch.items()}
    all_shards(batch, 4)
    assert set(batch) == set(before)
    for k in before:
        assert torch.equal(batch[k], before[k]), k


# ----------------------------------------------------------------------------------------------- padding
def test_padding_to_a_multiple_of_sp_size():
    S, sp = 10, 4  # padded to 12, shards of 3
    input_ids = rows(list(range(11, 21)), list(range(31, 41)))
    labels = input_ids.clone()
    labels[1, 4] = IGNORE
    batch = {"input_ids": input_ids, "labels": labels}
    shards = all_shards(batch, sp, pad_token_id=99)
    for shard in shards:
        for key in SEQ_KEYS:
            assert shard[key].shape == (2, 3), key
    assert torch.equal(concat(shards, "input_ids"), rows(
        [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 99, 99],
        [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 99, 99],
    ))
    assert torch.equal(concat(shards, "labels"), rows(
        [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, IGNORE, IGNORE],
        [31, 32, 33, 34, IGNORE, 36, 37, 38, 39, 40, IGNORE, IGNORE],
    ))
    assert torch.equal(concat(shards, "shift_labels"), rows(
        [12, 13, 14, 15, 16, 17, 18, 19, 20, IGNORE, IGNORE, IGNORE],
        [32, 33, 34, IGNORE, 36, 37, 38, 39, 40, IGNORE, IGNORE, IGNORE],
    ))
    assert torch.equal(concat(shards, "position_ids"), torch.arange(12).repeat(2, 1))
    # the last rank holds one real token and two pads
    assert torch.equal(shards[3]["input_ids"], rows([20, 99, 99], [40, 99, 99]))
    assert torch.equal(shards[3]["position_ids"], rows([9, 10, 11], [9, 10, 11]))


def test_default_pad_token_is_zero():
    batch = {"input_ids": torch.arange(1, 4).view(1, 3)}
    assert torch.equal(concat(all_shards(batch, 2), "input_ids"), rows([1, 2, 3, 0]))


def test_sequence_shorter_than_sp_size():
    batch = {"input_ids": rows([5]), "labels": rows([5])}
    shards = all_shards(batch, 4)
    assert torch.equal(concat(shards, "input_ids"), rows([5, 0, 0, 0]))
    assert torch.equal(concat(shards, "labels"), rows([5, IGNORE, IGNORE, IGNORE]))
    assert torch.equal(concat(shards, "shift_labels"), rows([IGNORE] * 4))
    assert torch.equal(concat(shards, "position_ids"), rows([0, 1, 2, 3]))


# ----------------------------------------------------------------------------------------------- other entries
def test_extra_sequence_tensor_is_sliced_and_zero_padded():
    B, S, H = 2, 6, 3
    emb = torch.randn(B, S, H)
    batch = {"input_ids": torch.ones(B, S, dtype=torch.long), "embeds": emb}
    shards = all_shards(batch, 2)
    assert [s["embeds"].shape for s in shards] == [(B, 3, H)] * 2
    assert torch.equal(shards[0]["embeds"], emb[:, :3])
    assert torch.equal(shards[1]["embeds"], emb[:, 3:])
    shards = all_shards(batch, 4)  # padded to 8
    assert [s["embeds"].shape for s in shards] == [(B, 2, H)] * 4
    assert torch.equal(concat(shards, "embeds"), torch.cat([emb, torch.zeros(B, 2, H)], dim=1))


def test_non_sequence_entries_pass_through_unchanged():
    B, S = 2, 8
    per_row = torch.tensor([3.0, 4.0])  # [B]
    matrix = torch.randn(B, 5)  # [B, not S]
    names = ["a", "b"]
    meta = {"source": "x"}
    batch = {"input_ids": torch.ones(B, S, dtype=torch.long), "weight": per_row, "other": matrix,
             "names": names, "tag": "packed", "meta": meta, "n": 7}
    for r, shard in enumerate(all_shards(batch, 4)):
        assert shard["weight"] is per_row
        assert shard["other"] is matrix
        assert shard["names"] is names and shard["names"] == ["a", "b"]
        assert shard["tag"] == "packed" and shard["meta"] is meta and shard["n"] == 7


def test_attention_mask_is_sharded_and_padding_targets_ignored():
    # right padding: row 0 has 6 real tokens, row 1 has 8
    input_ids = rows([11, 12, 13, 14, 15, 16, 0, 0], [21, 22, 23, 24, 25, 26, 27, 28])
    mask = rows([1, 1, 1, 1, 1, 1, 0, 0], [1] * 8)
    batch = {"input_ids": input_ids, "labels": input_ids.clone(), "attention_mask": mask}
    for sp in (2, 4):
        shards = all_shards(batch, sp)
        assert torch.equal(concat(shards, "attention_mask"), mask)  # the shard of the mask: `batch[...]` works
        assert torch.equal(concat(shards, "shift_labels"), rows(
            [12, 13, 14, 15, 16, IGNORE, IGNORE, IGNORE],
            [22, 23, 24, 25, 26, 27, 28, IGNORE],
        ))
        assert torch.equal(concat(shards, "position_ids"), torch.arange(8).repeat(2, 1))


def test_all_ones_attention_mask_changes_nothing_but_is_kept():
    input_ids = torch.arange(1, 9).view(1, 8)
    with_mask = all_shards({"input_ids": input_ids, "labels": input_ids, "attention_mask": torch.ones(1, 8)}, 2)
    without = all_shards({"input_ids": input_ids, "labels": input_ids}, 2)
    for a, b in zip(with_mask, without):
        assert set(a) == set(b) | {"attention_mask"}
        assert bool(a["attention_mask"].bool().all())
        for k in b:
            assert torch.equal(a[k], b[k])


@pytest.mark.parametrize("mask", [
    [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]],  # left padding
    [[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]],  # a hole
])
def test_left_padding_raises(mask):
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": torch.tensor(mask)}
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        shard_batch(batch, 2, 0)


@pytest.mark.parametrize("batch, fragment", [
    ((torch.ones(2, 4, dtype=torch.long),), "got tuple"),
    (torch.ones(2, 4, dtype=torch.long), "got Tensor"),
    ([{"input_ids": torch.ones(4)}], "got list"),
    ({"tokens": torch.ones(2, 4, dtype=torch.long)}, "with keys ['tokens']"),
])
def test_non_dict_or_missing_input_ids_raises_type_error(batch, fragment):
    with pytest.raises(TypeError) as err:
        shard_batch(batch, 2, 0)
    message = str(err.value)
    assert fragment in message
    assert "input_ids" in message and "Return a dict from your Dataset or collate_fn" in message


def test_input_ids_must_be_2d_tensor():
    with pytest.raises(TypeError, match=r"`input_ids` must be an integer tensor of shape \[B, S\]"):
        shard_batch({"input_ids": torch.ones(8, dtype=torch.long)}, 2, 0)
    with pytest.raises(TypeError, match=r"`input_ids` must be an integer tensor of shape \[B, S\]"):
        shard_batch({"input_ids": [[1, 2], [3, 4]]}, 2, 0)


# ----------------------------------------------------------------------------------------------- round trip
def reference_processing(batch, sp_size, pad_token_id):
    """The full batch's processed tensors, written out independently of the library (loops, no slicing tricks)."""
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    P = -(-S // sp_size) * sp_size
    mask = batch.get("attention_mask")
    out = {k: torch.empty(B, P, dtype=torch.long) for k in SEQ_KEYS}
    out["extra"] = torch.zeros(B, P, *batch["extra"].shape[2:])
    out["attention_mask"] = torch.zeros(B, P, dtype=torch.long)
    for b in range(B):
        for t in range(P):
            real = t < S
            out["input_ids"][b, t] = input_ids[b, t] if real else pad_token_id
            out["labels"][b, t] = batch["labels"][b, t] if real else IGNORE
            target_real = t + 1 < S and (mask is None or mask[b, t + 1] == 1)
            out["shift_labels"][b, t] = batch["labels"][b, t + 1] if target_real else IGNORE
            out["position_ids"][b, t] = t
            if real:
                out["extra"][b, t] = batch["extra"][b, t]
                out["attention_mask"][b, t] = 1 if mask is None else mask[b, t]
    return out


@pytest.mark.parametrize("B, S, sp", [(1, 8, 2), (2, 10, 4), (3, 7, 2), (2, 5, 4), (1, 12, 3), (2, 9, 1)])
def test_concatenated_shards_equal_the_full_processed_batch(B, S, sp):
    g = torch.Generator().manual_seed(S * 10 + sp)
    input_ids = torch.randint(1, 50, (B, S), generator=g)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    labels = torch.where(torch.rand(B, S, generator=g) < 0.2, torch.tensor(IGNORE), input_ids)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "extra": torch.randn(B, S, 2, 3),
             "names": [f"r{i}" for i in range(B)]}
    expected = reference_processing(batch, sp, pad_token_id=77)
    shards = all_shards(batch, sp, pad_token_id=77)
    s = expected["input_ids"].shape[1] // sp
    for r, shard in enumerate(shards):
        assert set(shard) == {*SEQ_KEYS, "extra", "names", "attention_mask"}
        for key in (*SEQ_KEYS, "extra", "attention_mask"):
            assert torch.equal(shard[key], expected[key][:, r * s:(r + 1) * s]), (key, r)
    for key in (*SEQ_KEYS, "extra", "attention_mask"):
        full = concat(shards, key)
        assert torch.equal(full, expected[key]), key
    # minus padding, the shards give back the user's own tensors
    assert torch.equal(concat(shards, "input_ids")[:, :S], input_ids)
    assert torch.equal(concat(shards, "extra")[:, :S], batch["extra"])
    assert torch.equal(concat(shards, "labels")[:, :S], labels)


# ----------------------------------------------------------------------------------------------- DataLoader
class Rows(torch.utils.data.Dataset):
    def __init__(self, n=4, S=10):
        self.data = torch.arange(1, n * S + 1).view(n, S)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class UserCollate:
    """A user's collate: a list of rows -> dict, with a non-tensor entry."""

    def __init__(self):
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        ids = torch.stack(samples)
        return {"input_ids": ids, "labels": ids.clone(), "source": ["user"] * len(samples)}


def test_install_wraps_the_users_collate_and_yields_shards():
    user = UserCollate()
    dataset = Rows()
    loader = DataLoader(dataset, batch_size=2, collate_fn=user)
    same = install_sharding_collate(loader, sp_size=4, sp_rank=1, pad_token_id=0)
    assert same is loader
    assert isinstance(loader.collate_fn, SequenceShardingCollate)
    assert loader.collate_fn.collate_fn is user
    batches = list(loader)
    assert user.calls == 2 and len(batches) == 2
    for i, batch in enumerate(batches):
        full = dataset.data[2 * i:2 * i + 2]  # S=10 padded to 12, rank 1 of 4 holds positions 3..5
        assert torch.equal(batch["input_ids"], full[:, 3:6])
        assert torch.equal(batch["shift_labels"], full[:, 4:7])
        assert torch.equal(batch["position_ids"], torch.tensor([[3, 4, 5]] * 2))
        assert batch["source"] == ["user", "user"]


def test_installing_twice_retargets_instead_of_stacking():
    user = UserCollate()
    dataset = Rows(n=2)
    loader = DataLoader(dataset, batch_size=2, collate_fn=user)
    install_sharding_collate(loader, sp_size=2, sp_rank=0, pad_token_id=0)
    install_sharding_collate(loader, sp_size=4, sp_rank=3, pad_token_id=5)
    wrapper = loader.collate_fn
    assert isinstance(wrapper, SequenceShardingCollate)
    assert wrapper.collate_fn is user
    assert (wrapper.sp_size, wrapper.sp_rank, wrapper.pad_token_id) == (4, 3, 5)
    (batch,) = list(loader)
    assert user.calls == 1
    assert torch.equal(batch["input_ids"], torch.tensor([[10, 5, 5], [20, 5, 5]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[9, 10, 11]] * 2))
    assert torch.equal(batch["labels"], torch.tensor([[10, IGNORE, IGNORE], [20, IGNORE, IGNORE]]))


def test_default_collate_is_used_when_the_user_has_none():
    class DictRows(Rows):
        def __getitem__(self, i):
            return {"input_ids": self.data[i], "labels": self.data[i].clone(), "idx": i}

    dataset = DictRows(n=4, S=8)
    loader = install_sharding_collate(DataLoader(dataset, batch_size=4), sp_size=2, sp_rank=1, pad_token_id=0)
    assert loader.collate_fn.collate_fn is default_collate
    assert SequenceShardingCollate(2, 0).collate_fn is default_collate
    (batch,) = list(loader)
    assert torch.equal(batch["input_ids"], dataset.data[:, 4:])
    assert torch.equal(batch["position_ids"], torch.arange(4, 8).repeat(4, 1))
    assert torch.equal(batch["idx"], torch.arange(4))  # [B] tensor: not sliced


def test_unbatched_dataloader_raises():
    loader = DataLoader(Rows(), batch_size=None)
    with pytest.raises(ValueError, match="batched DataLoaders"):
        install_sharding_collate(loader, 2, 0, 0)


def test_non_dataloader_raises():
    with pytest.raises(TypeError, match="torch DataLoaders"):
        install_sharding_collate([{"input_ids": torch.ones(1, 2)}], 2, 0, 0)


# ----------------------------------------------------------------------------------------------- loss
def test_cross_entropy_without_group_is_the_mean_over_valid_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, 1] = IGNORE
    targets[1, 4] = IGNORE
    targets[1, 0] = IGNORE
    loss = sequence_parallel_cross_entropy(logits, targets)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE)
    # also by hand: mean of -log p(target) over the 7 valid positions
    logp = torch.log_softmax(logits.detach().double(), dim=-1)
    valid = targets != IGNORE
    by_hand = -logp[valid].gather(1, targets[valid][:, None]).mean()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(loss.detach().double(), by_hand)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_cross_entropy_grad_scale_scales_gradient_not_value():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (1, 4), generator=g)
    plain_logits = logits.detach().clone().requires_grad_(True)
    scaled = sequence_parallel_cross_entropy(logits, targets, grad_scale=4.0)
    plain = sequence_parallel_cross_entropy(plain_logits, targets)
    torch.testing.assert_close(scaled.detach(), plain.detach())
    scaled.backward()
    plain.backward()
    torch.testing.assert_close(logits.grad, 4.0 * plain_logits.grad)


def test_cross_entropy_all_ignored_shard_is_zero_not_nan():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.full((2, 3), IGNORE)
    loss = sequence_parallel_cross_entropy(logits, targets, grad_scale=2.0)
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reduce_scatter", [True, False, None])
def test_deepspeed_divisor(stage, reduce_scatter):
    zero = {"stage": stage}
    if reduce_scatter is not None:
        zero["reduce_scatter"] = reduce_scatter
    expected = 4.0 if stage == 3 and reduce_scatter in (True, None) else 1.0  # reduce_scatter defaults to True
    assert deepspeed_divisor({"zero_optimization": zero}, 4) == expected


def test_deepspeed_divisor_without_zero_section():
    assert deepspeed_divisor({}, 4) == 1.0
    assert deepspeed_divisor({"zero_optimization": None}, 4) == 1.0


def test_broadcast_position_ids_row_is_expanded_then_sliced():
    batch = {"input_ids": torch.arange(12).view(2, 6), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    shards = [shard_batch(batch, 2, r) for r in range(2)]
    assert torch.equal(shards[0]["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert torch.equal(shards[1]["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 2]]))


def test_deepspeed_divisor_counts_data_parallel_replicas():
    assert deepspeed_divisor({"zero_optimization": {"stage": 2}}, sp_size=2, dp_size=3) == 3.0
    assert deepspeed_divisor({"zero_optimization": {"stage": 3}}, sp_size=2, dp_size=3) == 6.0
    assert deepspeed_divisor({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 2, 3) == 3.0


# ----------------------------------------------------------------------------------------------- packed documents
def test_packed_rows_give_document_offsets_and_no_cross_document_targets():
    # Row 0 packs documents of 3 and 3 tokens; row 1 one document of 4 then 2 (S=6, sp=4 pads to 8).
    input_ids = rows([11, 12, 13, 21, 22, 23], [31, 32, 33, 34, 41, 42])
    position_ids = rows([0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1])
    batch = {"input_ids": input_ids, "labels": input_ids.clone(), "position_ids": position_ids}
    shards = [shard_batch(batch, 4, r) for r in range(4)]
    info = shards[0]["_ulysses"]
    assert info.packed and info.seq_len == 6
    # flattened [2 × 8]: row 0 docs start at 0, 3 (the padding extends the last one); row 1 at 8, 12
    assert info.cu_seqlens.tolist() == [0, 3, 8, 12, 16]
    assert info.cu_seqlens.dtype == torch.int32 and info.max_seqlen == 5
    assert all(s["_ulysses"].cu_seqlens.tolist() == info.cu_seqlens.tolist() for s in shards)
    shift = torch.cat([s["shift_labels"] for s in shards], dim=1)
    assert shift.tolist() == [[12, 13, IGNORE, 22, 23, IGNORE, IGNORE, IGNORE],
                              [32, 33, 34, IGNORE, 42, IGNORE, IGNORE, IGNORE]]


def test_unpacked_rows_have_no_document_offsets():
    info = shard_batch({"input_ids": torch.ones(2, 8, dtype=torch.long)}, 2, 0)["_ulysses"]
    assert not info.packed and info.cu_seqlens is None and info.seq_len == 8


# ----------------------------------------------------------------------------------------------- batch contract
def _ids(B=2, S=8):
    return torch.arange(1, B * S + 1).view(B, S)


@pytest.mark.parametrize("batch, error, phrase", [
    ({"input_ids": torch.ones(2, 8)}, TypeError, "`input_ids` must be an integer tensor of shape [B, S]"),
    ({"input_ids": _ids(), "labels": _ids(2, 7)}, ValueError, "`labels` must be an integer tensor of shape [B, S] = [2, 8]"),
    ({"input_ids": _ids(), "labels": _ids().float()}, ValueError, "`labels` must be an integer tensor"),
    ({"input_ids": _ids(), "shift_labels": _ids(1, 8)}, ValueError, "`shift_labels` must be an integer tensor"),
    ({"input_ids": _ids(), "position_ids": torch.arange(8)}, ValueError,
     "`position_ids` must be an integer tensor of shape [B, S] = [2, 8] or [1, S] = [1, 8]"),
    ({"input_ids": _ids(), "position_ids": torch.arange(7)[None]}, ValueError, "got torch.int64 of shape [1, 7]"),
    ({"input_ids": _ids(), "attention_mask": torch.ones(2, 1, 8, 8)}, ValueError, "custom attention masks cannot be split"),
    ({"input_ids": _ids(), "labels": _ids(), "attention_mask": torch.ones(2, 1, 8, 8)}, ValueError, "attention_mask` is 4-D"),
    ({"input_ids": _ids(), "shift_labels": _ids(), "attention_mask": torch.ones(2, 1, 8, 8)}, ValueError,
     "give `position_ids` that restart at 0"),
    ({"input_ids": _ids(), "attention_mask": torch.ones(2, 9)}, ValueError, "`attention_mask` must be a [B, S] = [2, 8] padding mask"),
])
def test_batch_contract_names_the_key_and_the_expected_shape(batch, error, phrase):
    with pytest.raises(error) as err:
        shard_batch(batch, 2, 0)
    assert phrase in str(err.value)


def test_right_padding_with_any_position_on_the_pads_is_not_packing():
    ids = _ids(2, 8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    expected = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, 2, 1)
    for pad_positions in (0, 7, -1):
        positions = torch.arange(8).repeat(2, 1)
        positions[1, 5:] = pad_positions  # e.g. collators that write 0 on pads
        out = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask, "position_ids": positions}, 2, 1)
        assert not out["_ulysses"].packed
        assert torch.equal(out["shift_labels"], expected["shift_labels"])


def test_none_values_mean_absent():
    ids = _ids()
    out = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": None, "position_ids": None}, 2, 0)
    ref = shard_batch({"input_ids": ids, "labels": ids}, 2, 0)
    assert out.keys() == ref.keys()
    for key in ("input_ids", "shift_labels", "position_ids"):
        assert torch.equal(out[key], ref[key])


def test_fingerprint_sees_every_element_and_the_order():
    from lightning_ulysses.data.fingerprint import batch_fingerprint

    ids = _ids()
    base = batch_fingerprint({"input_ids": ids, "labels": ids})
    assert base == batch_fingerprint({"labels": ids.clone(), "input_ids": ids.clone()})  # key order irrelevant
    changed = ids.clone()
    changed[1, 7] += 1
    assert batch_fingerprint({"input_ids": changed, "labels": ids}) != base
    assert batch_fingerprint({"input_ids": ids.flip(0), "labels": ids}) != base
    assert batch_fingerprint({"input_ids": ids.int(), "labels": ids}) != base
    assert batch_fingerprint({"input_ids": ids[:, :7], "labels": ids}) != base
    assert 0 <= base < 2**62
    fingerprinted = shard_batch({"input_ids": ids, "labels": ids}, 2, 1, fingerprint=True)["_ulysses"]
    assert fingerprinted.fingerprint == base and fingerprinted.batch_size == 2


# ----------------------------------------------------------------------------------------------- halo plan
@pytest.mark.parametrize("padded_len, sp, ring", [(16, 2, 1), (16, 4, 1), (16, 2, 2), (16, 4, 2), (32, 4, 4),
                                                  (24, 3, 1), (48, 6, 3)])
def test_next_token_sources_point_at_the_next_position_of_the_row(padded_len, sp, ring):
    """For every layout, the token after each run of every rank's shard is found where the plan says (and the
    last position of the row has none); every rank sends the same number of first tokens."""
    from lightning_ulysses.data.halo import next_token_sources
    from lightning_ulysses.parallel.geometry import SequenceGeometry

    geometry = SequenceGeometry(sp, ring)
    index = {r: geometry.shard_index(padded_len, r) for r in range(sp)}
    plans = {r: next_token_sources(padded_len, geometry, r) for r in range(sp)}
    assert len({len(plan.starts) for plan in plans.values()}) == 1
    for r, plan in plans.items():
        for end, source in zip(plan.ends, plan.sources):
            following = int(index[r][end]) + 1
            if source is None:
                assert following == padded_len
            else:
                src_rank, run = source
                assert int(index[src_rank][plans[src_rank].starts[run]]) == following
        inside = [i for i in range(len(index[r]) - 1) if i not in plan.ends]
        assert all(int(index[r][i + 1]) == int(index[r][i]) + 1 for i in inside)


# ----------------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("sp, ring", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4), (6, 3), (6, 2)])
def test_geometry_cuts_every_padded_row_into_the_layouts_shards(sp, ring):
    """Every position of the padded row is held by exactly one SP rank; Ulysses-only shards are contiguous in rank
    order; with ring, ring rank i holds chunks i and 2R-1-i cut over its Ulysses ranks; full_order inverts the
    rank-major concatenation."""
    from lightning_ulysses.parallel.geometry import SequenceGeometry

    geometry = SequenceGeometry(sp, ring)
    for seq_len in (1, 7, 24, 37):
        padded = geometry.padded_length(seq_len)
        assert padded >= seq_len and padded % (sp * (2 if ring > 1 else 1)) == 0 and padded - seq_len < 2 * sp
        shards = [geometry.shard_index(padded, r) for r in range(sp)]
        assert sorted(torch.cat(shards).tolist()) == list(range(padded))
        assert all(len(s) == padded // sp for s in shards)
        if ring == 1:
            assert torch.equal(torch.cat(shards), torch.arange(padded))
        else:
            c, u = padded // (2 * ring), sp // ring
            for i in range(ring):
                held = torch.cat(shards[i * u:(i + 1) * u]).tolist()
                assert held == list(range(i * c, (i + 1) * c)) + list(range((2 * ring - 1 - i) * c,
                                                                            (2 * ring - i) * c))
        row = torch.arange(padded) * 10
        gathered = torch.cat([row[s] for s in shards])
        restored = torch.empty_like(row)
        restored[geometry.full_order(padded)] = gathered
        assert torch.equal(restored, row)
        assert geometry.shard_length(seq_len) == padded // sp
        span = geometry.contiguous_span(padded, sp - 1)
        if ring == 1:
            assert torch.equal(torch.arange(padded)[span], shards[-1])
        else:
            assert span is None


def test_tile_agreement_uses_the_shard_the_geometry_places_with_ring():
    """The step runner's agreed tile length is the step's padded shard (``padded_len / sp``), which with ring pads to
    a multiple of 2·sp: ceil(S/sp) was 1 short here (S=10, sp=4, ring 2: 16/4 = 4, not 3). One process, a real gloo
    group of one rank (the all-reduce's MAX is then the rank's own value)."""
    import tempfile
    from types import SimpleNamespace

    import torch.distributed as dist

    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.parallel.geometry import SequenceGeometry
    from lightning_ulysses.training.step_runner import StepRunner

    geometry = SequenceGeometry(4, 2)
    info = shard_batch({"input_ids": torch.arange(10)[None]}, 4, 1, ring_size=2)["_ulysses"]
    assert info.padded_len == geometry.padded_length(10) == 16 and -(-10 // 4) == 3
    layout = SimpleNamespace(sp_size=4, ring_size=2, geometry=geometry)
    runner = StepRunner.__new__(StepRunner)
    runner.layout, runner.device, runner.agree_on_tile_counts = layout, torch.device("cpu"), True
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", store=dist.FileStore(f"{directory}/store", 1), rank=0, world_size=1)
        try:
            assert runner._agreed_tile_shard_len(info) == geometry.shard_length(10) == 4
        finally:
            dist.destroy_process_group()
    runner.agree_on_tile_counts = False
    assert runner._agreed_tile_shard_len(info) is None

"""litdata's ``StreamingDataset`` + ``StreamingDataLoader`` under SP (:mod:`lightning_ulysses.data.litdata_streams`):
litdata splits its stream by the world; the strategy makes it split by the data-parallel replicas, with no change to
the user's litdata code. Against one device (SGD, fp32, relative difference <= 1e-5) at ZeRO 2 and at ZeRO 3 with
every parameter partitioned; each SP group reads the same samples, the replicas litdata's disjoint shares; a
mid-epoch ``fit(ckpt_path=...)`` continues with the samples and weights of the uninterrupted run."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("litdata")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

from tests.scenarios.litdata_streams import (BATCH, CONFIG, LR, NUM_ROWS, SEQ_LEN, SHUFFLE_SEED,  # noqa: E402
                                             streaming_loader, write_dataset)
from tests.support.launcher import launch  # noqa: E402
from tests.support.models import build_llama, tiny_llama_config  # noqa: E402

STEPS = 5
SAVE_AT = 3  # the dp=2 resume: with 2 workers, an odd batch count is where litdata's own resume would reorder
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """In this process litdata detects one process (the variables it reads first are the launched ranks' only)."""
    for name in ("WORLD_SIZE", "GLOBAL_RANK", "NNODES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("litdata") / "tokens")
    write_dataset(path)
    return path


# ------------------------------------------------------------------------------------------------ one device
def replica_loader(data_dir: str, dp_size: int, dp_rank: int, num_workers: int = 0):
    """The loader litdata itself gives rank ``dp_rank`` of a plain DDP run of ``dp_size`` processes."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.utilities.env import _DistributedEnv

    dataset = StreamingDataset(data_dir, shuffle=True, seed=SHUFFLE_SEED, drop_last=dp_size > 1)
    dataset.distributed_env = _DistributedEnv(world_size=dp_size, global_rank=dp_rank, num_nodes=1)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=num_workers)


def ids_of(loader) -> list[list[int]]:
    return [batch["index"].tolist() for batch in loader]


@functools.lru_cache(maxsize=None)
def one_device(data_dir: str, dp_size: int, num_workers: int = 0, steps: int = STEPS) -> dict:
    """The reference: plain transformers on one process, SGD; step k trains on batch k of every replica together
    (the global batch). ``dp_size=1``: the plain ``StreamingDataLoader`` of the user's code, on one device."""
    if dp_size == 1:
        replicas = [list(streaming_loader(data_dir, num_workers))]
    else:
        replicas = [list(replica_loader(data_dir, dp_size, rank, num_workers)) for rank in range(dp_size)]
    model = build_llama(tiny_llama_config(**CONFIG), 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, ids = [], []
    for step in range(steps):
        parts = [replica[step] for replica in replicas]
        ids.append([part["index"].tolist() for part in parts])
        loss = model(input_ids=torch.cat([p["input_ids"] for p in parts]),
                     labels=torch.cat([p["labels"] for p in parts])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "ids": ids, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def weights_rel(got: dict, expected: dict) -> float:
    return max(float((got[k] - v).norm() / v.norm()) for k, v in expected.items())


def assert_one_devices(result: dict, expected: dict, steps: slice = slice(None), weights: bool = True) -> None:
    """The run's losses are the reference's at ``steps``; its final weights (``weights``) the reference's final ones."""
    assert result["error_type"] is None, result["message"]
    worst = max(rel(a, b) for a, b in zip(result["losses"], expected["losses"][steps], strict=True))
    assert worst <= TOLERANCE, (worst, result["losses"], expected["losses"])
    if weights:
        assert weights_rel(result["weights"], expected["weights"]) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ in process
def test_litdatas_own_split_gives_sp_peers_other_samples_and_the_dp_split_the_same(data_dir):
    """Without the strategy's split, litdata splits a world of 2 (one SP group) into two halves: the two SP peers
    would read different samples (the SP-peer check's SPPeerMismatchError, pinned end to end below). The environment
    the strategy gives them instead is the same on both peers and reads what one device reads."""
    from litdata import StreamingDataLoader, StreamingDataset

    from lightning_ulysses.data.litdata_streams import data_parallel_env

    world_split = [ids_of(replica_loader(data_dir, 2, rank)) for rank in range(2)]
    assert not set(sum(world_split[0], [])) & set(sum(world_split[1], []))
    one = ids_of(streaming_loader(data_dir))
    assert sorted(sum(one, [])) == list(range(NUM_ROWS))
    env = data_parallel_env(1, 0)  # every SP peer's: it depends on the dp rank (and world) alone
    assert (env.world_size, env.global_rank, env.num_nodes) == (1, 0, 1)
    dataset = StreamingDataset(data_dir, shuffle=True, seed=SHUFFLE_SEED)
    dataset.distributed_env = env
    assert ids_of(StreamingDataLoader(dataset, batch_size=BATCH)) == one


def _prepare(loader, sp_rank: int, dp_size: int = 1, dp_rank: int = 0):
    from lightning_ulysses.data.loaders import ShardInfoQueue
    from lightning_ulysses.data.setup import prepare_dataloader
    from lightning_ulysses.patches import PatchStack

    layout = SimpleNamespace(sp_size=2, sp_rank=sp_rank, dp_size=dp_size, dp_rank=dp_rank, ring_size=1)
    patches = PatchStack()
    queues = {kind: ShardInfoQueue() for kind in ("train", "validate", "test", "predict")}
    return prepare_dataloader(loader, layout, queues, 1, None, None, 0, patches), patches


@pytest.mark.parametrize("combined", [False, True], ids=["StreamingDataset", "CombinedStreamingDataset"])
def test_the_prepared_loader_gives_each_sp_rank_its_shard_of_the_same_batches(data_dir, combined):
    """In process, through the strategy's loader preparation: both SP ranks get their half of every sequence of the
    same batches (the sharding step runs inside litdata's collate wrapper, also for a combined dataset, whose batches
    litdata packs with its bookkeeping); teardown gives the loader its collate function back."""
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

    def loader():
        dataset = StreamingDataset(data_dir, shuffle=True, seed=SHUFFLE_SEED)
        if combined:
            dataset = CombinedStreamingDataset([dataset, StreamingDataset(data_dir, seed=1)], iterate_over_all=True)
        return StreamingDataLoader(dataset, batch_size=BATCH)

    whole = list(loader())
    shards = []
    for sp_rank in range(2):
        original = loader()
        collate = original.collate_fn
        prepared, patches = _prepare(original, sp_rank)
        shards.append(list(prepared))
        assert prepared.state_dict()["current_epoch"] == 1
        patches.close()
        assert original.collate_fn is collate and "load_state_dict" not in original.__dict__
    assert len(shards[0]) == len(shards[1]) == len(whole) > 0
    for batch, first, second in zip(whole, *shards):
        assert first["input_ids"].shape == (BATCH, SEQ_LEN // 2)
        assert torch.equal(torch.cat([first["input_ids"], second["input_ids"]], 1), batch["input_ids"])
        assert torch.equal(first["index"], batch["index"]) and torch.equal(second["index"], batch["index"])


def test_one_loader_prepared_twice_is_cut_once(data_dir):
    """The same StreamingDataLoader object returned for two stages (train and val): the sharding step is re-targeted,
    not stacked; closing both stages gives the loader its collate function back."""
    loader = streaming_loader(data_dir)
    collate = loader.collate_fn
    _, train_patches = _prepare(loader, 1)
    val, val_patches = _prepare(loader, 1)
    for batch, shard in zip(streaming_loader(data_dir), val, strict=True):
        assert torch.equal(shard["input_ids"], batch["input_ids"][:, SEQ_LEN // 2:])
    val_patches.close()
    train_patches.close()
    assert loader.collate_fn is collate


def test_resuming_twice_in_the_sp_world_continues_the_stream_exactly(data_dir, monkeypatch):
    """``state_dict`` after some batches, ``load_state_dict`` into a new loader, a batch more, again: the batches are
    those of the uninterrupted epoch when the strategy holds the loader. litdata's own ``load_state_dict`` compares
    the saved split (the dp world) with the world it detects (here the 2 ranks of one SP group) and re-stripes:
    the second resume repeats samples (with DataLoader workers already the first one can reorder them: the sp=2 dp=2
    resume below runs with 2 workers)."""
    from litdata import StreamingDataLoader, StreamingDataset

    from lightning_ulysses.data.litdata_streams import data_parallel_env

    monkeypatch.setenv("WORLD_SIZE", "2")  # what litdata detects on a rank of the SP world

    def loader(prepared: bool):
        dataset = StreamingDataset(data_dir, shuffle=True, seed=SHUFFLE_SEED)
        dataset.distributed_env = data_parallel_env(1, 0)
        plain = StreamingDataLoader(dataset, batch_size=BATCH)
        return _prepare(plain, 0) if prepared else (plain, None)

    def twice_resumed(prepared: bool) -> list[list[int]]:
        first, patches = loader(prepared)
        iterator = iter(first)
        ids = [next(iterator)["index"].tolist()]
        state = first.state_dict()
        for taken in (1, None):  # one batch after the first resume, the rest after the second
            if patches is not None:
                patches.close()
            first, patches = loader(prepared)
            first.load_state_dict(state)
            iterator = iter(first)
            ids += [batch["index"].tolist() for _, batch in zip(range(taken or 99), iterator)]
            state = first.state_dict()
        if patches is not None:
            patches.close()
        return ids

    uninterrupted = ids_of(loader(False)[0])
    assert twice_resumed(True) == uninterrupted
    assert twice_resumed(False) != uninterrupted


def test_a_split_that_gives_replicas_unequal_lengths_is_refused_naming_drop_last(data_dir):
    from litdata import StreamingDataLoader, StreamingDataset

    loader = StreamingDataLoader(StreamingDataset(data_dir, drop_last=False), batch_size=1)
    with pytest.raises(ValueError, match=r"gives the 5 data-parallel replicas .*Pass `drop_last=True`"):
        _prepare(loader, 0, dp_size=5, dp_rank=0)
    loader = StreamingDataLoader(StreamingDataset(data_dir, drop_last=True), batch_size=1)
    prepared, patches = _prepare(loader, 0, dp_size=5, dp_rank=4)
    assert len(prepared) == NUM_ROWS // 5
    patches.close()


# ------------------------------------------------------------------------------------------------ sp=2, dp=1
@pytest.fixture(scope="module")
def sp_runs(data_dir, tmp_path_factory):
    common = {"data_dir": data_dir}
    cases = [
        {"name": "zero2", "stage": 2, "steps": STEPS, **common},
        {"name": "zero3", "stage": 3, "partitioned": True, "steps": STEPS, **common},
        # ZeRO 3: 2 steps, resumed for 1 (checkpoint at step 3), resumed again for the rest
        {"name": "first", "stage": 3, "partitioned": True, "steps": 2, "save_every": 2, **common},
        {"name": "middle", "stage": 3, "partitioned": True, "steps": 3, "save_every": 1,
         "resume": "first/step=2.ckpt", **common},
        {"name": "last", "stage": 3, "partitioned": True, "steps": STEPS, "resume": "middle/step=3.ckpt", **common},
        # ZeRO 2: trainer.save_checkpoint after a fit that max_steps stopped mid-epoch, then resumed from it
        {"name": "saved-after-fit", "stage": 2, "steps": SAVE_AT, "save_to": "after-fit.ckpt", **common},
        {"name": "resumed-after-fit", "stage": 2, "steps": STEPS, "resume": "after-fit.ckpt", **common},
        {"name": "unsplit", "stage": 2, "steps": STEPS, "unsplit": True, **common},
    ]
    root = tmp_path_factory.mktemp("litdata-sp")
    return launch(2, "litdata_streams:run", {"root": str(root), "cases": cases}, timeout=300)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_sp2_trains_as_one_device_on_the_same_samples(sp_runs, data_dir, name):
    expected = one_device(data_dir, 1)
    for rank in sp_runs:
        assert rank[name]["step_ids"] == [ids[0] for ids in expected["ids"]]  # both SP peers: one device's batches
    assert_one_devices(sp_runs[0][name], expected)


def test_sp2_resumes_mid_epoch_twice_with_the_samples_of_the_uninterrupted_run(sp_runs, data_dir):
    expected = one_device(data_dir, 1)
    for name, steps in (("first", slice(0, 2)), ("middle", slice(2, 3)), ("last", slice(3, STEPS))):
        for rank in sp_runs:
            assert rank[name]["step_ids"] == [ids[0] for ids in expected["ids"][steps]], name
            assert rank[name]["global_step"] == steps.stop
        assert_one_devices(sp_runs[0][name], expected, steps, weights=name == "last")


def test_sp2_resumes_from_a_checkpoint_saved_after_fit(sp_runs, data_dir):
    """``trainer.save_checkpoint`` after ``fit`` stopped mid-epoch: the loader's state still describes the
    data-parallel split (it stays on the dataset after teardown), so the resumed fit continues the stream."""
    expected = one_device(data_dir, 1)
    for name, steps in (("saved-after-fit", slice(0, SAVE_AT)), ("resumed-after-fit", slice(SAVE_AT, STEPS))):
        for rank in sp_runs:
            assert rank[name]["step_ids"] == [ids[0] for ids in expected["ids"][steps]], name
        assert_one_devices(sp_runs[0][name], expected, steps, weights=name == "resumed-after-fit")


def test_without_the_split_the_sp_peer_check_stops_the_first_step(sp_runs):
    for rank in sp_runs:
        result = rank["unsplit"]
        assert result["error_type"] == "SPPeerMismatchError", result["message"]
        assert result["global_step"] == 0


# ------------------------------------------------------------------------------------------------ sp=2, dp=2
@pytest.fixture(scope="module")
def dp_runs(data_dir, tmp_path_factory):
    common = {"data_dir": data_dir}
    cases = [  # ZeRO 2 with 2 DataLoader workers: the first SAVE_AT steps, then resumed from their checkpoint
        {"name": "first-half", "stage": 2, "steps": SAVE_AT, "save_every": SAVE_AT, "num_workers": 2, **common},
        {"name": "resumed", "stage": 2, "steps": STEPS, "resume": f"first-half/step={SAVE_AT}.ckpt",
         "num_workers": 2, **common},
        {"name": "zero3", "stage": 3, "partitioned": True, "steps": STEPS, **common},
    ]
    root = tmp_path_factory.mktemp("litdata-dp")
    return launch(4, "litdata_streams:run", {"root": str(root), "cases": cases}, timeout=400)


@pytest.mark.parametrize("name", ["first-half", "zero3"])
def test_sp2_dp2_each_group_reads_its_replicas_share_and_trains_as_one_device(dp_runs, data_dir, name):
    """ZeRO 3 over all steps; ZeRO 2 over the first SAVE_AT (the rest are the resumed run's, below)."""
    expected = one_device(data_dir, 2, num_workers=2 if name == "first-half" else 0)
    steps = len(dp_runs[0][name]["losses"])
    assert [rank[name]["dp_rank"] for rank in dp_runs] == [0, 0, 1, 1]
    for rank in dp_runs:
        assert rank[name]["step_ids"] == [ids[rank[name]["dp_rank"]] for ids in expected["ids"][:steps]]
    seen = [set(sum(rank[name]["step_ids"], [])) for rank in dp_runs]
    assert seen[0] == seen[1] and seen[2] == seen[3] and not seen[0] & seen[2]  # disjoint shares of the replicas
    assert_one_devices(dp_runs[0][name], expected, slice(0, steps), weights=steps == STEPS)


def test_sp2_dp2_resumes_mid_epoch_with_the_samples_of_the_uninterrupted_run(dp_runs, data_dir):
    expected = one_device(data_dir, 2, num_workers=2)
    for rank in dp_runs:
        dp_rank = rank["resumed"]["dp_rank"]
        assert rank["resumed"]["step_ids"] == [ids[dp_rank] for ids in expected["ids"][SAVE_AT:]]
    assert_one_devices(dp_runs[0]["resumed"], expected, slice(SAVE_AT, None))

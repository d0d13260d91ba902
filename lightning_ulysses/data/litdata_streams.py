"""litdata's streaming datasets under sequence parallelism: the stream split over the data-parallel replicas.

litdata (Lightning's streaming data library) splits a ``StreamingDataset``'s stream itself, not through a sampler: the
dataset keeps the distributed environment it detected when it was created (``dataset.distributed_env``, a
``litdata.utilities.env._DistributedEnv`` of world size, global rank and nodes, from ``torch.distributed`` or the
``WORLD_SIZE``/``GLOBAL_RANK``/``NNODES`` variables) and hands every rank of that world its own share of the chunks.
Under ``sp_size > 1`` every rank of an SP group would then read other samples (the SP-peer check stops that with
``SPPeerMismatchError``). For every loader the strategy prepares
(:func:`lightning_ulysses.data.setup.prepare_dataloader`) whose dataset is a ``StreamingDataset``,
``CombinedStreamingDataset`` or ``ParallelStreamingDataset``, usually a ``StreamingDataLoader``,
:func:`split_streams_by_dp` makes litdata split by the data-parallel replicas instead, with no change to the user's
litdata code:

1. **The split.** Every ``StreamingDataset`` in the loader gets ``distributed_env = _DistributedEnv(world_size=dp_size,
   global_rank=dp_rank, num_nodes=...)``: the environment litdata would detect in a plain DDP run of ``dp_size``
   processes. The ranks of an SP group share their ``dp_rank`` and so read the same samples in the same order; the
   replicas read litdata's ``dp_size`` disjoint shares. ``num_nodes`` is the node count litdata detects (it only
   decides which node caches which chunks) when it divides ``dp_size``, else 1 (litdata's single-node assignment:
   ``dp_size // num_nodes`` ranks per node must be a whole, non-zero number). Either way the environment depends only
   on ``dp_rank`` and the world, the same on all SP peers, so no split can differ between them.
2. **Equal lengths.** With ``dp_size > 1`` the replicas must read the same number of batches (each step reduces
   gradients over all of them). litdata gives the last replica the remainder when ``drop_last`` is off; such a split
   is refused before the first batch, naming ``drop_last=True`` (litdata's default in a distributed run).
3. **The collate step.** A ``StreamingDataLoader`` wraps the collate function in its own
   ``StreamingDataLoaderCollateFn``, which for combined and parallel datasets packs the batch into a dict of
   bookkeeping entries that the loader unpacks. The strategy's sequence-sharding step
   (:class:`~lightning_ulysses.data.sharding.SequenceShardingCollate`) is moved inside that wrapper, so it cuts the
   user's (or litdata's) collated batch.
4. **Mid-epoch resume.** ``StreamingDataLoader.state_dict()`` records the split the dataset uses (``world_size =
   dp_size``) and the samples each replica has taken; Lightning saves it in checkpoints and loads it on
   ``fit(ckpt_path=...)``. ``load_state_dict`` compares the saved world with the one litdata *detects* (the whole
   world), which would take every SP run for a changed topology and re-stripe the stream (elastic resume); while the
   strategy has prepared the loader, its ``load_state_dict`` runs with litdata's detection seeing the data-parallel
   world (the three variables above, set for that call only), so the resumed epoch continues with exactly the samples
   of the uninterrupted run.

Changes 3 and 4 are undone in teardown with the strategy's other changes. The split (1) stays on the dataset: a
checkpoint written after the stage (``trainer.save_checkpoint`` after ``fit``) must still describe the data-parallel
split, and a later stage sets it again for its own layout. Anything else that makes SP peers read different samples
(a custom wrapper around a litdata dataset, a dataset the loader does not expose) is not recognised here and is
stopped by the SP-peer check at the first step.

Tested on local data (``tests/test_litdata.py``). Untested: a remote dataset whose cache is smaller than a node's
share, where litdata deletes each chunk once read; it counts a chunk's readers by its split, which leaves out the SP
peers sharing the chunk.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from lightning_ulysses.data.sharding import SequenceShardingCollate
from lightning_ulysses.parallel.layout import SequenceParallelLayout
from lightning_ulysses.patches import PatchStack, take_from_instance

# litdata's overrides of what it detects (litdata.utilities.env._DistributedEnv.detect).
_DETECTED_VARIABLES = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES")


def split_streams_by_dp(dataloader: Any, layout: SequenceParallelLayout, patches: PatchStack) -> bool:
    """Make a loader over litdata streaming datasets read by the data-parallel replicas (see the module docstring).
    Call after the sequence-sharding collate step is installed. Returns whether the loader streams litdata data
    (``False``, and nothing changed, for any other loader, and whenever litdata was never imported)."""
    if "litdata" not in sys.modules:  # a litdata dataset exists only once litdata was imported
        return False
    datasets = streaming_datasets(getattr(dataloader, "dataset", None))
    if not datasets:
        return False
    env = data_parallel_env(layout.dp_size, layout.dp_rank)
    for dataset in datasets:
        dataset.distributed_env = env
    check_equal_lengths(datasets, layout.dp_size, env.num_nodes)
    _nest_sharding_in_streaming_collate(dataloader, patches)
    _load_state_in_data_parallel_world(dataloader, env, patches)
    return True


def streaming_datasets(dataset: Any) -> list[Any]:
    """The ``StreamingDataset``s that make up ``dataset`` (itself, or the children of a combined or parallel
    dataset, recursively); empty for anything else."""
    from litdata.streaming.dataset import StreamingDataset
    from litdata.utilities.base import _BaseStreamingDatasetWrapper

    if isinstance(dataset, StreamingDataset):
        return [dataset]
    if isinstance(dataset, _BaseStreamingDatasetWrapper):
        return [leaf for child in getattr(dataset, "_datasets", ()) for leaf in streaming_datasets(child)]
    return []


def data_parallel_env(dp_size: int, dp_rank: int) -> Any:
    """The ``_DistributedEnv`` litdata would detect in a DDP run of ``dp_size`` processes, as rank ``dp_rank``."""
    from litdata.utilities.env import _DistributedEnv

    nodes = max(1, int(_DistributedEnv.detect().num_nodes))
    num_nodes = nodes if dp_size % nodes == 0 else 1
    return _DistributedEnv(world_size=dp_size, global_rank=dp_rank, num_nodes=num_nodes)


def check_equal_lengths(datasets: list[Any], dp_size: int, num_nodes: int) -> None:
    """Refuse a split that gives the data-parallel replicas different numbers of samples (``drop_last`` off and a
    remainder): the longer replica would run a step the others never join."""
    if dp_size == 1:
        return
    from litdata.utilities.env import _DistributedEnv

    for dataset in datasets:
        if dataset.drop_last:
            continue
        lengths = [_replica_length(dataset, _DistributedEnv(dp_size, rank, num_nodes)) for rank in range(dp_size)]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"The litdata StreamingDataset over {dataset.input_dir.path or dataset.input_dir.url} gives the"
                f" {dp_size} data-parallel replicas {lengths} samples (drop_last=False: the last replica takes the"
                " remainder), so one replica would run a step the others never join. Pass"
                " `drop_last=True` to the StreamingDataset or the StreamingDataLoader (litdata's default in a"
                " distributed run)."
            )


def _replica_length(dataset: Any, env: Any) -> int:
    original = dataset.distributed_env
    dataset.distributed_env = env
    try:
        return int(dataset.get_len(dataset.num_workers, dataset.batch_size or 1))
    finally:
        dataset.distributed_env = original


def _nest_sharding_in_streaming_collate(dataloader: Any, patches: PatchStack) -> None:
    """``SequenceShardingCollate(StreamingDataLoaderCollateFn(user))`` -> ``StreamingDataLoaderCollateFn(
    SequenceShardingCollate(user))``: the shard is cut from the collated batch before litdata packs its bookkeeping
    around it (combined and parallel datasets). Given back in teardown."""
    from litdata.streaming.dataloader import StreamingDataLoaderCollateFn

    sharding = getattr(dataloader, "collate_fn", None)
    if not (isinstance(sharding, SequenceShardingCollate)
            and isinstance(sharding.collate_fn, StreamingDataLoaderCollateFn)):
        return
    streaming = sharding.collate_fn
    user = streaming.collate_fn
    if isinstance(user, SequenceShardingCollate):  # prepared before (one loader for two stages): re-targeted
        user = user.collate_fn
    inner = SequenceShardingCollate(sharding.sp_size, sharding.sp_rank, user, sharding.pad_token_id,
                                    sharding.fingerprint, sharding.ring_size)

    def restore(loader: Any = dataloader, original: Any = streaming) -> None:
        loader.collate_fn = original

    patches.apply(f"{type(dataloader).__name__}: sequence-sharding collate inside litdata's collate",
                  lambda: setattr(dataloader, "collate_fn", StreamingDataLoaderCollateFn(inner)), restore)


def _load_state_in_data_parallel_world(dataloader: Any, env: Any, patches: PatchStack) -> None:
    """While the strategy has the loader, its ``load_state_dict`` runs with litdata detecting ``env`` (see the module
    docstring, 4)."""
    load_state_dict = getattr(dataloader, "load_state_dict", None)
    if load_state_dict is None or not callable(load_state_dict):
        return

    def load_in_data_parallel_world(state: Any) -> Any:
        with litdata_detects(env):
            return load_state_dict(state)

    def restore(loader: Any = dataloader) -> None:
        take_from_instance(loader, "load_state_dict", None)

    patches.apply(f"{type(dataloader).__name__}.load_state_dict in the data-parallel world",
                  lambda: setattr(dataloader, "load_state_dict", load_in_data_parallel_world), restore)


@contextmanager
def litdata_detects(env: Any) -> Iterator[None]:
    """Inside the block, litdata's ``_DistributedEnv.detect()`` returns ``env`` (through the environment variables it
    reads first); they are as before after it."""
    saved = {name: os.environ.get(name) for name in _DETECTED_VARIABLES}
    os.environ.update(WORLD_SIZE=str(env.world_size), GLOBAL_RANK=str(env.global_rank), NNODES=str(env.num_nodes))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

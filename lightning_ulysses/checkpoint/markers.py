"""Checkpoints of :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy`: completion markers, file digests hashed and
checked over the ranks, the records of the layout and the Hugging Face models, the exact resume position of an epoch
cut short, and loading into a ZeRO-3 engine for evaluation.

A checkpoint is Lightning's DeepSpeed checkpoint: a *directory* (``epoch=0-step=8.ckpt/``) that every rank writes its
ZeRO shard into. On top of it the strategy keeps two promises:

* **Complete or rejected.** Before any rank writes, rank 0 puts ``ulysses_checkpoint.json`` with ``"complete": false``
  into the directory; once every rank has written (DeepSpeed's closing barrier), it replaces it atomically with the
  list of files and their sizes and ``"complete": true``. A run killed while saving leaves a directory that
  :func:`checkpoint_status` reports incomplete, that :func:`find_last_complete_checkpoint` skips and that the
  strategy refuses to load. (DeepSpeed's own ``latest`` file is no such marker: rank 0 writes it without waiting for
  the other ranks.)
* **Exact resume.** The train DataLoader remembers how many batches of which epoch it has handed out
  (:class:`lightning_ulysses.data.loaders.ResumePosition`); Lightning saves that with the checkpoint and, on
  ``fit(ckpt_path=...)``, the loader skips exactly those batches of the restored epoch at the index level (no sample
  is loaded to be thrown away). Without it Lightning restarts a mid-epoch checkpoint's epoch at its first batch and
  ends it early.

The strategy's save/load is :mod:`lightning_ulysses.checkpoint.saving`; export to portable files is
:mod:`lightning_ulysses.checkpoint.export`; loading on another layout is :mod:`lightning_ulysses.checkpoint.resharding`.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.checkpoint import integrity
from lightning_ulysses.models import hf, hf_attention

PathLike = Union[str, "os.PathLike[str]"]

MARKER = "ulysses_checkpoint.json"
CLIENT_STATE_KEY = "ulysses"  # the strategy's record inside Lightning's checkpoint dict (layout, HF models)
FORMAT_VERSION = 2  # 2: files map to {"size", "sha256"}; 1: files map to sizes
# The tag (sub-directory of a checkpoint directory) that Lightning's DeepSpeedStrategy always saves DeepSpeed's files
# under: ``<checkpoint>/checkpoint/mp_rank_00_model_states.pt``, ... Readers that find no ``latest`` file use it.
DEEPSPEED_TAG = "checkpoint"


# ----------------------------------------------------------------------------------------------- completeness
def begin_checkpoint(path: PathLike, record: dict[str, Any]) -> None:
    """Mark ``path`` as being written (rank 0, before any rank writes into it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json_atomically(path / MARKER, {"format": FORMAT_VERSION, "complete": False, **record})


def checkpoint_files(path: PathLike) -> list[str]:
    """The files of a checkpoint directory (relative paths, sorted), without the marker."""
    path = Path(path)
    return [str(f.relative_to(path)) for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != MARKER and not f.name.startswith(f".{MARKER}")]


def commit_checkpoint(path: PathLike, record: dict[str, Any], digests: Optional[dict[str, str]] = None) -> None:
    """Mark ``path`` complete (rank 0, after every rank has written): every file with its size and, when given, its
    SHA-256 (``digests``: name -> hex, hashed by all ranks in parallel), then ``complete``."""
    path = Path(path)
    files = {name: {"size": (path / name).stat().st_size,
                    **({"sha256": digests[name]} if digests and name in digests else {})}
             for name in checkpoint_files(path)}
    _write_json_atomically(path / MARKER, {"format": FORMAT_VERSION, "complete": True, **record, "files": files})


def _write_json_atomically(target: Path, content: dict[str, Any]) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_directory(target.parent)


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_marker(path: PathLike) -> Optional[dict[str, Any]]:
    """The content of a checkpoint's ``ulysses_checkpoint.json``; ``None`` if it has none (or it is unreadable)."""
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def checkpoint_status(path: PathLike) -> tuple[bool, str]:
    """``(True, "")`` if ``path`` is a complete checkpoint written by this strategy, else ``(False, why)``.

    Complete means: the marker says so, every file it lists exists with the recorded size, and DeepSpeed's ``latest``
    names a tag directory that exists.
    """
    path = Path(path)
    if not path.is_dir():
        return False, f"{path} is not a directory (UlyssesDeepSpeedStrategy checkpoints are directories)"
    marker = read_marker(path)
    if marker is None:
        return False, f"{path} has no {MARKER}: it was not written (to the end) by UlyssesDeepSpeedStrategy"
    if not marker.get("complete"):
        return False, (f"{path} is incomplete: its writing started but never finished (the run stopped while saving,"
                       " e.g. a rank was killed)")
    for name, entry in marker.get("files", {}).items():
        size = entry["size"] if isinstance(entry, dict) else entry  # format 1 recorded sizes only
        file = path / name
        if not file.is_file():
            return False, f"{path} is incomplete: {name} is missing"
        if file.stat().st_size != size:
            return False, f"{path} is corrupt: {name} has {file.stat().st_size} bytes, {size} were written"
    latest = path / "latest"
    if not latest.is_file() or not (path / latest.read_text().strip()).is_dir():
        return False, f"{path} is incomplete: DeepSpeed's `latest` file or its tag directory is missing"
    return True, ""


def is_complete_checkpoint(path: PathLike) -> bool:
    return checkpoint_status(path)[0]


def find_last_complete_checkpoint(dirpath: PathLike) -> Optional[Path]:
    """The complete checkpoint in ``dirpath`` (e.g. ``ModelCheckpoint.dirpath``) with the highest global step (the
    newest one on a tie); ``None`` if there is none. Incomplete ones (a run killed while saving) are skipped.

    ``trainer.fit(model, ckpt_path=find_last_complete_checkpoint(dirpath))`` resumes after a crash. Lightning's own
    ``ckpt_path="last"`` picks the newest ``*.ckpt`` by modification time, complete or not.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    best: Optional[tuple[int, float, Path]] = None
    for candidate in dirpath.iterdir():
        if not is_complete_checkpoint(candidate):
            continue
        marker = read_marker(candidate) or {}
        key = (int(marker.get("global_step", -1)), (candidate / MARKER).stat().st_mtime, candidate)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def verify_digests(path: PathLike, names: Optional[list[str]] = None) -> list[str]:
    """Re-hash ``names`` (default: every file the marker lists) and return those whose bytes differ from the
    recorded SHA-256 (files recorded without a digest are not checked)."""
    path = Path(path)
    files = (read_marker(path) or {}).get("files", {})
    return integrity.mismatches(path, files, sorted(files) if names is None else names)


def over_shares(names: list[str], work: Callable[[list[str]], Any], rank: int, world: int) -> list[Any]:
    """``work(this rank's share of names)`` on every rank in parallel (rank ``r`` takes every world-th name); the
    results of all ranks, on every rank (one ``all_gather_object``)."""
    import torch.distributed as dist

    mine = work(integrity.share_of(names, rank, world))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def hash_files_over_ranks(path: PathLike, rank: int, world: int, broadcast: Callable[[Any], Any]) -> dict[str, str]:
    """SHA-256 of every file of the checkpoint, each rank hashing its share; the union on every rank. ``broadcast``:
    rank 0's object to every rank (the strategy's)."""
    names = broadcast(checkpoint_files(path) if rank == 0 else None)
    parts = over_shares(names, lambda share: integrity.digests(Path(path), share), rank, world)
    return {name: digest for part in parts for name, digest in part.items()}


def verify_digests_over_ranks(path: PathLike, rank: int, world: int) -> None:
    """Every rank re-hashes its share of the marker's files; any mismatch raises a ``ValueError`` on every rank."""
    files = sorted((read_marker(path) or {}).get("files", {}))
    parts = over_shares(files, lambda share: verify_digests(path, share), rank, world)
    wrong = [name for part in parts for name in part]
    if wrong:
        raise ValueError(f"Cannot resume from this checkpoint: {digest_mismatch_error(path, wrong)}")


def digest_mismatch_error(path: PathLike, wrong: list[str]) -> str:
    return (f"{path} is corrupt: the bytes of {', '.join(sorted(wrong))} differ from what was written (SHA-256 recorded"
            " in its ulysses_checkpoint.json when it was saved). Resume from another checkpoint, e.g."
            f" `lightning_ulysses.find_last_complete_checkpoint(...)`. To skip this check (e.g. for huge checkpoints"
            " on trusted storage): `UlyssesDeepSpeedStrategy(verify_checkpoints=False)` /"
            " `export_checkpoint(..., verify=False)`.")


def stage_change_error(path: PathLike, saved_stage: int, stage: int) -> str:
    return (f"{path} was saved at ZeRO stage {saved_stage} and this run uses stage {stage}: without ZeRO the optimizer"
            f" state is PyTorch's own, with ZeRO DeepSpeed's shards, so a run resumes between ZeRO 1, 2 and 3 but not"
            f" between 0 and the others. Resume with"
            f" `UlyssesDeepSpeedStrategy(stage={saved_stage}, ...)`, or export the weights with"
            " `lightning_ulysses.export_checkpoint(...)` and start a new fit from them at stage"
            f" {stage} (the optimizer state is lost).")


def validate_for_loading(path: PathLike, world_size: int, zero_stage: Optional[int] = None) -> Optional[dict[str, Any]]:
    """Raise a ``ValueError`` if ``path`` cannot be resumed by ``world_size`` ranks (at ``zero_stage``, when
    resuming training); return its marker. Sizes only: :func:`verify_digests` checks the bytes.

    A checkpoint without a marker was not written by this strategy (e.g. by Lightning's ``DeepSpeedStrategy``): it
    is left to DeepSpeed to load or reject.
    """
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        return None
    complete, why = checkpoint_status(path)
    if not complete:
        raise ValueError(
            f"Cannot resume from this checkpoint: {why}. Resume from the last complete one:"
            f" `ckpt_path=lightning_ulysses.find_last_complete_checkpoint({str(path.parent)!r})`."
        )
    saved_stage = marker.get("zero_stage")
    if zero_stage is not None and saved_stage is not None and int(saved_stage) != zero_stage \
            and 0 in (int(saved_stage), zero_stage):  # ZeRO 1, 2, 3 convert into each other at load (resharding)
        raise ValueError(stage_change_error(path, int(saved_stage), zero_stage))
    return marker


@contextmanager
def zero3_inference_loading(engine: Any) -> Iterator[None]:
    """Let a ZeRO-3 *inference* engine (``validate``/``test``/``predict`` with a ``ckpt_path``) load a checkpoint
    exactly.

    DeepSpeed loads the module's weights there from the consolidated fp32 state (``load_optimizer_states=False``):
    parameters that are gathered at that moment (ZeRO-3's small "persistent" ones, or all of them in a small model)
    get the new values in their full ``data`` only, while their partitions keep the old weights; the others are
    gathered, written and re-partitioned. Then it calls ``optimizer._restore_from_bit16_weights()``, which the
    parameter-offload "optimizer" of an engine without an optimizer (``DeepSpeedZeRoOffload``) lacks
    (``AttributeError``). Left alone, the first batch would run with the checkpoint's weights and every later one
    with the stale partitions once ZeRO-3 has released and re-gathered them (measured: a validation loss between
    the two checkpoints'). Here that call writes every gathered parameter back into its partition instead, so all
    batches see the checkpoint's weights. ``engine=None`` or a training engine: no change.
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or _compat.has_restore_from_bit16(optimizer):
        yield
        return

    def write_loaded_weights_into_partitions() -> None:
        gathered = [p for p in engine.module.parameters()
                    if _compat.is_zero3_gathered(p)]
        if gathered:  # every rank loaded the same state dict, so each rank's full data is the checkpoint's
            gathered[0].partition(param_list=gathered, has_been_updated=True)

    with _compat.restore_from_bit16_override(optimizer, write_loaded_weights_into_partitions):
        yield


# ----------------------------------------------------------------------------------------------- what is recorded
def hf_model_records(root: nn.Module) -> dict[str, dict[str, Any]]:
    """For every Hugging Face model in ``root``: its attribute path, class and *plain* config (as before the
    strategy prepared it: original attention, original ``use_cache``), so an export can rebuild it. A model wrapped
    by PEFT (``get_peft_model``) is recorded under the wrapper's path with the adapters' configs (``"peft"``)."""
    records: dict[str, dict[str, Any]] = {}
    found = {id(m): m for m in hf.find_pretrained_models(root)}
    peft_wrappers = {id(m.get_base_model()): (name, m) for name, m in root.named_modules() if _is_peft_model(m)}
    for name, module in root.named_modules():
        if id(module) not in found:
            continue
        config = module.config.to_dict()
        if hf.original_use_cache(module) is not None:  # the model's own setting, not fit's (cache off)
            config["use_cache"] = hf.original_use_cache(module)
        record = {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "config": config,
            "attn_implementation": hf_attention.attention_implementation(module),
        }
        if id(module) in peft_wrappers:
            name, wrapper = peft_wrappers[id(module)]
            record["peft"] = {adapter: _plain(cfg.to_dict()) for adapter, cfg in wrapper.peft_config.items()}
        records[name] = record
    return records


def _is_peft_model(module: nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model") and hasattr(module, "base_model")


def _plain(value: Any) -> Any:
    """Enums, sets and tuples as plain values (the record is loaded without importing PEFT's classes)."""
    from enum import Enum

    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


def continue_truncated_epoch(checkpoint: dict[str, Any], batches_per_epoch: float) -> bool:
    """Make a checkpoint taken after ``fit`` stopped inside an epoch (``max_steps``, ``trainer.should_stop``) resume
    *inside* that epoch, at its next batch, as a checkpoint taken during the epoch does.

    Lightning closes an epoch that ``max_steps`` cut short like a finished one (``epoch_progress`` completed), so a
    ``trainer.save_checkpoint`` after such a ``fit`` would resume with the next epoch and skip the rest of this one.
    When the train loader's recorded position confirms the epoch is unfinished, the epoch's "processed/completed"
    counts are taken back (and ``epoch``); nothing else changes. Returns whether the checkpoint was changed.
    """
    loops = checkpoint.get("loops") or {}
    fit = loops.get("fit_loop")
    if not fit or not batches_per_epoch or batches_per_epoch == float("inf"):
        return False
    try:
        epochs = fit["epoch_progress"]
        batches = fit[_compat.BATCH_PROGRESS_KEY]
        loaders = fit.get("state_dict", {}).get("combined_loader") or []
    except (KeyError, TypeError):
        return False
    done_in_epoch = batches["current"]["completed"]
    closed = all(p["ready"] == p["started"] == p["processed"] == p["completed"] > 0
                 for p in (epochs["current"], epochs["total"]))
    cut_short = (0 < done_in_epoch < batches_per_epoch and batches["current"]["ready"] == done_in_epoch
                 and not batches.get("is_last_batch"))
    position_known = len(loaders) == 1 and loaders[0].get("batches") == done_in_epoch
    if not (closed and cut_short and position_known):
        return False
    fit = {**fit, "epoch_progress": {k: {**v, "processed": v["processed"] - 1, "completed": v["completed"] - 1}
                                     for k, v in epochs.items()}}
    checkpoint["loops"] = {**loops, "fit_loop": fit}
    checkpoint["epoch"] = checkpoint.get("epoch", 1) - 1
    return True

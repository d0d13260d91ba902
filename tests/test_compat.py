"""Guards for every private-API touch point of :mod:`lightning_ulysses._compat`: each test fails when the upstream
name, signature or behaviour the package relies on changes, so that an upgrade of Lightning, DeepSpeed, torch or
transformers breaks a named test here instead of training silently wrong. In-process, no launch.

The checks themselves live in :mod:`lightning_ulysses.drift.touch_points`, one registry that the strategy also runs at
run time when a library is installed at an untested version (:mod:`lightning_ulysses.drift.guard`); the behaviours
that need a real fit are pinned here only."""

from __future__ import annotations

import ast

import pytest
import torch

from lightning_ulysses import _compat
from lightning_ulysses.drift.touch_points import REGISTRY, decoders_packing_from_four_rows


@pytest.mark.parametrize("point", REGISTRY, ids=[point.name for point in REGISTRY])
def test_touch_point_is_unchanged(point):
    """Each registered touch point is the upstream code the package was written against (digests, signatures, op
    schemas and small behaviours; a new digest means upstream changed the method: compare the code that copies or
    relies on it, then update the digest in lightning_ulysses/drift/touch_points.py)."""
    assert point.problem() is None, point.problem()


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_the_overrides_take_the_arguments_of_the_methods_they_replace(front_end):
    """The strategies' overrides of Lightning's and Fabric's private methods (whose digests the registry pins) take
    the same arguments."""
    import inspect

    from lightning_ulysses.drift import touch_points

    if front_end == "trainer":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lightning_ulysses.strategy import UlyssesDeepSpeedStrategy
        names = touch_points.LIGHTNING_ENGINE_SETUP
    else:
        from lightning.fabric.strategies import DeepSpeedStrategy

        from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy
        names = touch_points.FABRIC_OVERRIDDEN
    for name in names:
        ours, theirs = getattr(UlyssesDeepSpeedStrategy, name), getattr(DeepSpeedStrategy, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_the_registry_covers_each_library_and_front_end():
    covered = {(point.package, front_end) for point in REGISTRY for front_end in point.front_ends}
    assert {(package, front_end) for package in ("torch", "lightning", "deepspeed", "transformers")
            for front_end in ("trainer", "fabric")} <= covered
    assert len({point.name for point in REGISTRY}) == len(REGISTRY)


# ================================================================================================ Lightning
def _tiny_fit(accumulate: int = 2, batches: int = 3, **trainer_kwargs):
    """A plain one-device fit of a one-layer module that records ``_compat`` answers from inside its steps."""
    from lightning.pytorch import LightningModule, Trainer

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.continues: list[bool] = []

        def training_step(self, batch, batch_idx):
            self.continues.append(_compat.window_continues(self.trainer))
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(batches, 2), batch_size=1)

    module = Tiny()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulate, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                      **trainer_kwargs)
    trainer.fit(module)
    return trainer, module


def test_lightning_fit_loop_touch_points():
    """``window_continues`` (``fit_loop._should_accumulate``) answers Lightning's windows, the last batch of an epoch
    ending one; ``continue_epoch_at`` moves the four counts of the epoch's batch progress together; the loop state in
    a checkpoint holds the batch progress under ``BATCH_PROGRESS_KEY``; ``train_loader_of`` finds the module's loader;
    ``attached_trainer`` is the module's Trainer or ``None``; ``device_mesh`` returns what ``set_device_mesh`` set."""
    trainer, module = _tiny_fit(accumulate=2, batches=3)
    assert module.continues == [True, False, False]  # window of 2, then the epoch's last batch ends a window

    current = trainer.fit_loop.epoch_loop.batch_progress.current
    before = (current.ready, current.started, current.processed, current.completed)
    _compat.continue_epoch_at(trainer, current.ready + 5)
    assert (current.ready, current.started, current.processed, current.completed) == tuple(v + 5 for v in before)

    assert _compat.BATCH_PROGRESS_KEY in trainer.fit_loop.state_dict()
    assert set(trainer.fit_loop.state_dict()[_compat.BATCH_PROGRESS_KEY]["current"]) >= {"ready", "completed"}

    loader = _compat.train_loader_of(trainer)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 3

    assert _compat.attached_trainer(module) is trainer
    from lightning.pytorch import LightningModule

    assert _compat.attached_trainer(LightningModule()) is None
    marker = object()
    _compat.set_device_mesh(module, marker)
    assert module.device_mesh is marker


def _code_without_docstrings(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_every_private_touch_point_lives_in_compat():
    """No module of the package but ``_compat`` (and the touch-point checks of ``drift``) names the private APIs
    guarded here."""
    from pathlib import Path

    import lightning_ulysses

    private = ("_should_accumulate", "batch_progress", "_data_source", "_get_ckpt_name", "_link_all_hp_params",
               "_restore_from_bit16_weights", "_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups",
               "torch.ops.aten._", "remove_module_hooks(", "ds_grad_is_ready", "._device_mesh", "'_trainer'",
               "._attn_implementation", "grad_partitions_flat_buffer", "_hf_deepspeed_config_weak_ref", "._from_config(", "._forward_pre_hooks",
               "._forward_hooks", "_storage_Use_Count")
    root = Path(lightning_ulysses.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        if path.name == "_compat.py" or path.relative_to(root).as_posix() == "drift/touch_points.py":
            continue  # the door and the checks of what is behind it
        code = _code_without_docstrings(path.read_text())
        hits = [name for name in private if name in code]
        if hits:
            found[str(path.relative_to(root))] = hits
    assert not found, f"private-API touch points outside _compat: {found}"


def test_a_storage_counts_its_views_and_frees_in_place():
    """The layer checkpoint frees a storage only when no other tensor views it (:func:`storage_use_count` against a
    lone storage's count) and tells the memory trackers (:func:`release_storage`): a torch that counted otherwise,
    or could not free in place, fails here."""
    from lightning_ulysses import _compat

    lone = torch.empty(64)
    assert _compat.storage_use_count(lone) == _compat.LONE_STORAGE_USE_COUNT
    view = lone[8:]
    assert _compat.storage_use_count(lone) > _compat.LONE_STORAGE_USE_COUNT
    del view
    assert _compat.storage_use_count(lone) == _compat.LONE_STORAGE_USE_COUNT
    assert _compat.storage_key(lone) == _compat.storage_key(lone[1:]) != _compat.storage_key(torch.empty(64))
    told = []
    _compat.STORAGE_RELEASED.append(lambda key, nbytes: told.append((key, nbytes)))
    try:
        key = _compat.storage_key(lone)
        _compat.release_storage(lone)
    finally:
        _compat.STORAGE_RELEASED.pop()
    assert lone.untyped_storage().nbytes() == 0 and lone.shape == (64,)
    assert told == [(key, 64 * 4)]


def test_the_decoders_that_pack_only_from_four_row_positions_are_those_the_table_names():
    """:data:`PACKING_FROM_FOUR_ROWS` is re-derived from the installed transformers: the modeling modules whose
    decoder takes text positions from ``[4, B, S]`` positions only (``position_ids.shape[0] == 4``): exactly them on
    the tested transformers (at run time on another version, only a decoder the table lacks stops a run)."""
    from lightning_ulysses.families.multimodal_positions import PACKING_FROM_FOUR_ROWS

    found = decoders_packing_from_four_rows()
    assert found == PACKING_FROM_FOUR_ROWS, (sorted(found - PACKING_FROM_FOUR_ROWS),
                                            sorted(PACKING_FROM_FOUR_ROWS - found))

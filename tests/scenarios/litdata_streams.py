"""litdata under SP (``tests/test_litdata.py``): a LightningModule whose ``train_dataloader`` is the plain litdata
code, ``StreamingDataLoader(StreamingDataset(dir, shuffle=True))``, over a token dataset written by
``litdata.optimize``; trained by ``UlyssesDeepSpeedStrategy`` with no change to that code."""

from __future__ import annotations

import os

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # litdata asks PyPI for a newer version otherwise

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_ulysses import UlyssesDeepSpeedStrategy  # noqa: E402
from tests.support.models import SEED, VOCAB, CausalLM, tiny_llama_config  # noqa: E402
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer  # noqa: E402

NUM_ROWS = 24
SEQ_LEN = 64
BATCH = 2
SHUFFLE_SEED = 5
LR = 0.5
CONFIG = dict(num_kv_heads=2)


def token_row(index: int) -> dict[str, Any]:
    """Sample ``index`` of the dataset (``litdata.optimize``'s function): its id, tokens, labels = tokens."""
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(1, VOCAB, (SEQ_LEN,), generator=g)
    return {"index": index, "input_ids": ids, "labels": ids.clone()}


def write_dataset(output_dir: str) -> None:
    """The token dataset in litdata's chunked format (small chunks: several per epoch and per replica)."""
    import multiprocessing

    import litdata

    # litdata's optimize sets the process-wide start method to "spawn" (force=True) and leaves it so: every later
    # DataLoader with workers in this process would then pickle its dataset (a test's local class fails there)
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(fn=token_row, inputs=list(range(NUM_ROWS)), output_dir=output_dir, chunk_bytes="4KB",
                         num_workers=1, mode=None)
    finally:
        multiprocessing.set_start_method(before, force=True)


def streaming_loader(data_dir: str, num_workers: int = 0) -> Any:
    """What a litdata user writes."""
    from litdata import StreamingDataLoader, StreamingDataset

    return StreamingDataLoader(StreamingDataset(data_dir, shuffle=True, seed=SHUFFLE_SEED), batch_size=BATCH,
                               num_workers=num_workers)


class StreamingLM(CausalLM):
    """The tiny Llama trained on the litdata stream; records the sample ids of every step."""

    def __init__(self, data_dir: str, num_workers: int = 0) -> None:
        super().__init__(tiny_llama_config(**CONFIG), lr=LR)
        self.data_dir = data_dir
        self.num_workers = num_workers
        self.step_ids: list[list[int]] = []

    def train_dataloader(self):
        return streaming_loader(self.data_dir, self.num_workers)

    def training_step(self, batch, batch_idx):
        self.step_ids.append(batch.pop("index").tolist())
        return super().training_step(batch, batch_idx)


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].float().item())


def _weights(trainer, module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=trainer.strategy.zero_stage_3):
        return {k: v.detach().float().clone() for k, v in params.items()}


def fit(case: dict, root: Path) -> dict[str, Any]:
    """One fit: ``steps`` SGD steps at ZeRO ``stage`` (``partitioned``: every parameter partitioned); ``save_every``:
    ModelCheckpoint every that many steps; ``save_to``: ``trainer.save_checkpoint`` there after ``fit``; ``resume``:
    ``fit(ckpt_path=...)``; ``unsplit``: without the strategy's litdata split (what litdata does by itself)."""
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)  # Lightning's teardown removes it after every fit
    seed_everything(SEED, verbose=False)
    module = StreamingLM(case["data_dir"], case.get("num_workers", 0))
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=case["stage"])
    if case.get("partitioned"):
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    losses = StepLosses()
    callbacks: list[Callback] = [losses]
    if case.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=root / case["name"], every_n_train_steps=case["save_every"],
                                         save_top_k=-1, filename="{step}"))
    trainer = make_trainer(strategy, case["steps"], callbacks=callbacks,
                           enable_checkpointing=bool(case.get("save_every")))
    result: dict[str, Any] = {"error_type": None, "message": None}
    resume = str(root / case["resume"]) if case.get("resume") else None
    try:
        if case.get("unsplit"):
            from lightning_ulysses.data import setup

            original, setup.split_streams_by_dp = setup.split_streams_by_dp, lambda *args: False
            try:
                trainer.fit(module, ckpt_path=resume)
            finally:
                setup.split_streams_by_dp = original
        else:
            trainer.fit(module, ckpt_path=resume)
    except Exception as err:  # noqa: BLE001 - the test asserts on type and message
        result.update(error_type=type(err).__name__, message=str(err))
    result.update(losses=losses.losses, step_ids=module.step_ids, global_step=trainer.global_step,
                  dp_rank=strategy.dp_rank if strategy._layout is not None else None)
    if result["error_type"] is None and case.get("save_to"):
        trainer.save_checkpoint(root / case["save_to"])
    if result["error_type"] is None:
        weights = _weights(trainer, module)
        result["weights"] = weights if torch.distributed.get_rank() == 0 else None
    return result


def run(payload: dict) -> dict[str, Any]:
    root = Path(payload["root"])
    return {case["name"]: fit(case, root) for case in payload["cases"]}

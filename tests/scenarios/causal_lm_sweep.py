"""The sweep's SP fits (``benchmarks/causal_lm_sweep.py``, ``tests/test_causal_lm_sweep.py``), as
``launch(2, "causal_lm_sweep:run", {"models": {model_type: class name}, "setting": ..., ...})``: every model built
tiny by ``tests/support/sweep.py`` and fitted with ``UlyssesDeepSpeedStrategy(sp_size=2)`` at the sweep's setting
(``zero2``, ``zero3`` with every parameter partitioned, ``bf16`` (bf16-mixed at ZeRO 2), ``packed`` rows with
``sdpa_per_document=True``, ``bf16_packed`` both) for ``STEPS`` SGD steps, one after the other in the same two processes, or stopped with an
error. Rank 0 reports losses and final weights (gathered at ZeRO 3); every rank reports its error, and whether the
strategy's own code raised it.

``payload["progress"]`` (a folder, optional): each rank writes every model's result there as soon as it has it, so
that a caller keeps them when a later model kills the processes. ``payload["strategy"]`` (optional): more strategy
keywords for every fit (``tests/test_offload_attention.py``: ``offload_attention``). ``payload["model_timeout"]`` (seconds, optional):
a fit that runs longer ends the process (its result says so), instead of hanging the launch.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support import sweep
from tests.support.sweep import STEPS, build, format_exception, forward_kwargs, lr_for

# Read once: Lightning's environment teardown removes WORLD_SIZE from os.environ after each fit.
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class SweepLM(LightningModule):
    """The LightningModule a user writes around a Hugging Face causal LM."""

    def __init__(self, model_type: str, class_name: str, steps: int, setting: str = sweep.ZERO2) -> None:
        super().__init__()
        self.setting = setting
        self.model = build(model_type, class_name)
        self.lr, self.steps = lr_for(model_type), steps
        self.forward_kwargs = forward_kwargs(model_type)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch, **self.forward_kwargs).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        rows = [{k: v[0] for k, v in b.items()} for b in sweep.rows_of(self.setting, self.steps)]
        return DataLoader(rows, batch_size=1)  # in order; every rank of the SP group reads the same rows


def _strategy_and_precision(setting: str, options: dict) -> tuple[UlyssesDeepSpeedStrategy, str]:
    if setting == sweep.ZERO3:
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=3, **options)
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
        return strategy, "32-true"
    precision = "bf16-mixed" if setting in (sweep.BF16, sweep.BF16_PACKED) else "32-true"
    packed = setting in (sweep.PACKED, sweep.BF16_PACKED)
    return UlyssesDeepSpeedStrategy(sp_size=2, stage=2, sdpa_per_document=packed, **options), precision


def _final_weights(module: SweepLM, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        return {k: v.detach().float().clone() for k, v in params.items()}


def _fit(model_type: str, class_name: str, steps: int, setting: str = sweep.ZERO2,
         options: Optional[dict] = None) -> dict[str, Any]:
    result: dict[str, Any] = {"error": None}
    module = None
    start = time.monotonic()
    try:
        module = SweepLM(model_type, class_name, steps, setting)
        strategy, precision = _strategy_and_precision(setting, options or {})
        trainer = Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision=precision,
                          max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                          use_distributed_sampler=False)
        trainer.fit(module)
        result["parameter_dtypes"] = sorted({str(p.dtype) for p in module.model.parameters()})
        final = _final_weights(module, 3 if setting == sweep.ZERO3 else 2)  # every rank joins the gather
        if int(os.environ.get("RANK", "0")) == 0:
            result["final"] = final
    except Exception as err:  # noqa: BLE001 - the sweep classifies the error
        result.update(format_exception(err))
        result.pop("final", None)
    result["seconds"] = round(time.monotonic() - start, 1)
    result["losses"] = list(module.losses) if module is not None else []
    return result


def _save(folder: Path, model_type: str, result: dict) -> None:
    path = folder / f"{model_type}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(path)


def run(payload: dict) -> dict:
    """``payload["setting"]`` (one setting, results by model type) or ``payload["settings"]`` (several, results by
    ``"<model type>@<setting>"``: the suite's sample, every setting in one launch)."""
    from lightning_ulysses.offload import attention_block

    rank = os.environ.get("RANK", "0")
    if payload.get("rotary_tile_bytes"):  # the rotary tiles of offload_attention at the sweep's tiny shapes
        from lightning_ulysses.offload import rotary_tiles

        rotary_tiles.TILE_BYTES = int(payload["rotary_tile_bytes"])
    if payload.get("emulate_host"):  # a GPU's host copies on this CPU: the CUDA paths of the ALST + offload switches
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        import host_emulation

        from lightning_ulysses.offload import layer_checkpoint

        host_emulation.checkpoints_on_a_host()
        host_emulation.attention_chunks_on_a_host()
        layer_checkpoint.HOST_MIN_BYTES = 1024  # the sweep's tiny shapes: q is 4 KiB; what is smaller stays
    folder = Path(payload["progress"]) / f"rank{rank}" if payload.get("progress") else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    timeout = payload.get("model_timeout")
    settings = payload.get("settings")
    runs = ([(f"{m}@{s}", m, c, s) for s in settings for m, c in payload["models"].items()] if settings else
            [(m, m, c, payload.get("setting", sweep.ZERO2)) for m, c in payload["models"].items()])
    results = {}
    for key, model_type, class_name, setting in runs:
        os.environ["WORLD_SIZE"] = str(WORLD_SIZE)  # Lightning's teardown removes it after every fit
        watchdog = None
        if timeout:
            def expire(key=key):
                if folder is not None:
                    _save(folder, key, {"error": f"TimeoutError: the fit ran past {timeout} s",
                                        "raised_by_strategy": False, "losses": [], "timed_out": True})
                print(f"[sweep] {key}: timed out after {timeout} s", flush=True)
                os._exit(3)

            watchdog = threading.Timer(timeout, expire)
            watchdog.daemon = True
            watchdog.start()
        owned = attention_block.OWNED_CALLS[0]
        results[key] = _fit(model_type, class_name, payload.get("steps", STEPS), setting, payload.get("strategy"))
        results[key]["owned_attention_calls"] = attention_block.OWNED_CALLS[0] - owned  # offload_attention's blocks
        if watchdog is not None:
            watchdog.cancel()
        if folder is not None:
            _save(folder, key, results[key])
        print(f"[sweep] {key}: {results[key]['error'] or 'trained'}", flush=True)
    return results

"""The exchange of the sequence mixers' projected channels (``tests/test_mixer_exchange.py``), on ``sp`` processes:
one mixer layer of every family sharded against itself whole (exactness, bytes per rank, warnings), the largest
tensor autograd saves in one layer, whole training steps of the Qwen3.5-shaped and the Llama model of
``benchmarks/sweep.py`` with their exchange bytes counted, and mixers whose forward does not go as their family
expects."""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models.form_check import probe_running
from tests.support.mixer_exchange import (FAMILY_CONFIGS, NARROW_CONFIGS, attention_layer_bytes,
                                          counting_exchange_bytes, mixer_of, sharded_layer_run)
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer

LAYER_LEN = 64  # tokens of the per-layer runs
SAVED_LEN = 2048  # tokens of the saved-tensor runs (activations outgrow the weights)
STEP_LEN = 256  # tokens of the whole training steps


def layers(payload: dict) -> dict:
    """Every family's mixer layer sharded against itself whole; one packed run; the saved-tensor runs; an MHA
    layer's bytes at the same width."""
    dist.init_process_group("gloo")
    try:
        out: dict[str, Any] = {"families": {}, "saved": {}}
        for name, (arch, overrides) in FAMILY_CONFIGS.items():
            mixer, config = mixer_of(arch, overrides)
            out["families"][name] = sharded_layer_run(mixer, config.hidden_size, LAYER_LEN)
            out["families"][name]["hidden"] = config.hidden_size
        mixer, config = mixer_of(*FAMILY_CONFIGS["gated delta net (qwen3_5)"])
        out["packed"] = sharded_layer_run(mixer, config.hidden_size, LAYER_LEN, documents=(20, 30, 14))
        for name, (arch, overrides) in NARROW_CONFIGS.items():
            mixer, config = mixer_of(arch, overrides)
            run = sharded_layer_run(mixer, config.hidden_size, SAVED_LEN, record_saved=True)
            out["saved"][name] = {"largest": run["largest_saved"], "hidden": config.hidden_size,
                                  "narrowed": _narrowed_width(mixer), "differences": run["differences"]}
        out["attention"] = {width: attention_layer_bytes(width, 64, LAYER_LEN) for width in (256, 768)}
        return out
    finally:
        dist.destroy_process_group()


def _narrowed_width(mixer: torch.nn.Module) -> int:
    """Channels per position of this rank's narrowed input projections (the rows received and the deferred gate's
    placeholders)."""
    from lightning_ulysses.models.mixer_heads import head_slicing

    slicing = head_slicing(mixer, dist.get_rank(), dist.get_world_size())
    return sum(len(slicing.rows[name]) for name in slicing.inputs)


def _sweep_model(arch: str):
    """The model ``benchmarks/sweep.py --arch {arch}`` trains (hidden 256, 4 layers, 4 heads), vocabulary 1000."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep.py"
    spec = importlib.util.spec_from_file_location("_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)  # type: ignore[union-attr]
    args = SimpleNamespace(arch=arch, hidden=256, heads=4, layers=4, vocab=1000, seq_len=STEP_LEN)
    return sweep._model(args)


class _StepLM(LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _CountSecondStep(Callback):
    """The exchange bytes of the second training step, forward and backward (the model-form check's probe left
    out)."""

    def __init__(self) -> None:
        self.sent: Counter = Counter()
        self._stack = ExitStack()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.sent = self._stack.enter_context(counting_exchange_bytes(lambda: not probe_running()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stack.close()


def _fit(model, steps: int = 2, seq_len: int = STEP_LEN, vocab: int = 1000) -> dict:
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)  # Lightning's teardown removes it after every fit
    module = _StepLM(model)
    counter = _CountSecondStep()
    rows = torch.randint(1, vocab, (steps, seq_len), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader([{"input_ids": r, "labels": r.clone()} for r in rows], batch_size=1)
    result: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=LAUNCH_WORLD_SIZE, stage=2), steps,
                                   callbacks=[counter], use_distributed_sampler=False)
            trainer.fit(module, data)
        except Exception as err:  # noqa: BLE001 - the test asserts on the message
            result["error"] = f"{type(err).__name__}: {err}"
    result.update(losses=module.losses, sent=dict(counter.sent), warnings=[str(w.message) for w in caught])
    return result


def steps(payload: dict) -> dict:
    """Whole training steps: the sweep's Qwen3.5-shaped hybrid and Llama (exchange bytes of the second step)."""
    out = {}
    for arch in ("qwen3_5", "llama"):
        seed_everything(0, verbose=False)
        out[arch] = _fit(_sweep_model(arch))
    return out


def run(payload: dict) -> dict:
    out = {"layers": layers(payload), "steps": steps(payload)}
    if payload.get("toys"):
        out["toys"] = toys(payload)
    return out


def toys(payload: dict) -> dict:
    """The tiny lfm2 hybrid three times: as it is; with its mixer transforming its input before projecting it (runs
    the gather path, with a warning); with its mixer reading its input's content beyond the projections (NaN: the
    model-form check stops the fit)."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    from tests.support.architectures import SEQ_LEN, VOCAB, build_model

    class TransformsItsInput(Lfm2ShortConv):
        def forward(self, hidden_states, *args, **kwargs):  # the cache argument's name changes between releases
            return super().forward(hidden_states * 1.0, *args, **kwargs)

    class ReadsItsInput(Lfm2ShortConv):
        def forward(self, hidden_states, *args, **kwargs):
            seq_len = hidden_states.shape[1]
            B, C, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
            x = x + hidden_states.mean(-1)[:, None, :]  # the input's content, not through a projection
            y = C * self.conv(B * x)[..., :seq_len]
            return self.out_proj(y.transpose(-1, -2).contiguous())

    out = {}
    for label, cls in (("plain", None), ("transforms", TransformsItsInput), ("reads", ReadsItsInput)):
        seed_everything(0, verbose=False)
        model = build_model("lfm2")
        if cls is not None:
            model.model.layers[0].conv.__class__ = cls
        out[label] = _fit(model, steps=3, seq_len=SEQ_LEN, vocab=VOCAB)
    return out

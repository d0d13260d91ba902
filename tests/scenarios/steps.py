"""The training steps people write, run under SP=2 through a real Trainer (``tests/test_steps.py``).

Each case is a way of writing ``training_step`` (``STEPS``, keyed by the row name) plus the data and strategy it runs
with. A case reports the losses, the trained weights (rank 0, gathered under ZeRO-3), whether the weights were still
the initial ones when it stopped, the exception it ended with (type, message, seconds from the start of ``fit``), how
many optimizer steps and micro-batches ran, and what a generation callback produced.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, seed_everything
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, VOCAB, CausalLM, TokenDataset, VarLenDataset, pad_right_collate, tiny_llama_config
from tests.support.training import Recorder, make_trainer, run_cases


class WeightedRows(Dataset):
    """Token rows with a per-sample weight ``[B]`` and per-token weights ``[B, S]`` (extra batch keys)."""

    def __init__(self, num_rows: int, seq_len: int, seed: int = 17) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(1, VOCAB, (num_rows, seq_len), generator=g)
        self.sample_weight = torch.rand(num_rows, generator=g) + 0.5
        self.token_weight = torch.rand(num_rows, seq_len, generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone(), "sample_weight": self.sample_weight[i],
                "token_weight": self.token_weight[i]}


def _regulariser(module) -> torch.Tensor:
    return 1e-3 * sum(p.float().pow(2).sum() for p in module.parameters())


def _tutorial(module, batch) -> torch.Tensor:
    """DeepSpeed's / accelerate's Ulysses tutorial loss code, pasted into training_step."""
    import torch.distributed.nn.functional as dist_fn

    group = module.trainer.strategy.sp_group
    loss = module.model(**batch).loss
    good_tokens = (batch["shift_labels"] != -100).sum()
    losses = dist_fn.all_gather(loss, group=group)
    tokens = dist_fn.all_gather(good_tokens, group=group)
    return sum(l * t for l, t in zip(losses, tokens)) / sum(tokens)


# The ways of writing the step. Each takes (LightningModule, batch) and returns the loss.
STEPS: dict[str, Callable[[Any, dict], torch.Tensor]] = {
    "model_loss": lambda m, b: m.model(**b).loss,
    "labels_no_positions": lambda m, b: m.model(input_ids=b["input_ids"], labels=b["labels"]).loss,
    "positional_args": lambda m, b: m.model(b["input_ids"], labels=b["labels"]).loss,
    "mask_and_labels": lambda m, b: m.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                            labels=b["labels"]).loss,
    "labels_are_input_ids": lambda m, b: m.model(input_ids=b["input_ids"], labels=b["input_ids"]).loss,
    "helper_no_positions": lambda m, b: m.trainer.strategy.cross_entropy(m.model(input_ids=b["input_ids"]).logits,
                                                                         b["shift_labels"]),
    "shift_labels_no_positions": lambda m, b: m.model(input_ids=b["input_ids"], labels=b["labels"],
                                                      shift_labels=b["shift_labels"]).loss,
    "regulariser": lambda m, b: m.model(**b).loss + _regulariser(m),
    "edited_labels": lambda m, b: _edited_labels(m, b),
    "squared_global_mean": lambda m, b: _squared_global_mean(m, b),
    "scaled_plus_token_mean_aux": lambda m, b: _scaled_plus_aux(m, b),
    "weighted_tokens": lambda m, b: m.trainer.strategy.cross_entropy(
        m.model(input_ids=b["input_ids"]).logits, b["shift_labels"],
        weight=m.trainer.strategy.next_token_values(b["token_weight"]) * b["sample_weight"][:, None]),
    "token_mean_of_token_losses": lambda m, b: _token_mean_of_token_losses(m, b),
    # refused (each is a different function on every rank, or cannot be computed from a shard)
    "own_shift": lambda m, b: _own_shift(m, b),
    "per_shard_cross_entropy": lambda m, b: F.cross_entropy(
        m.model(**b).logits.flatten(0, 1).float(), b["shift_labels"].flatten(), ignore_index=-100),
    "aux_on_shard_logits": lambda m, b: _aux_on_shard_logits(m, b),
    "tutorial_loss": _tutorial,
    "shifted_inputs": lambda m, b: m.model(input_ids=b["input_ids"][:, :-1], labels=b["labels"][:, 1:]).loss,
    "arange_positions": lambda m, b: m.model(input_ids=b["input_ids"], labels=b["labels"],
                                             position_ids=torch.arange(b["input_ids"].shape[1])[None]).loss,
    "custom_mask": lambda m, b: m.model(input_ids=b["input_ids"], labels=b["labels"],
                                        attention_mask=torch.ones_like(b["input_ids"]).tril(-1)).loss,
}


def _edited_labels(module, batch) -> torch.Tensor:
    """Labels edited in the step (low token ids masked out), then the whole batch passed on."""
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] < 40, -100)
    return module.model(**batch).loss


def _scaled_plus_aux(module, batch) -> torch.Tensor:
    out = module.model(**batch)
    z = out.logits.float().logsumexp(-1).pow(2)  # [B, s] z-loss per token
    return out.loss * 0.5 + 1e-2 * module.trainer.strategy.token_mean(z)


def _squared_global_mean(module, batch) -> torch.Tensor:
    out = module.model(**batch)
    mean = module.trainer.strategy.token_mean(out.logits.float().logsumexp(-1))  # the same on every rank
    return out.loss + 1e-2 * (mean - 4.0).pow(2)


def _token_mean_of_token_losses(module, batch) -> torch.Tensor:
    logits = module.model(input_ids=batch["input_ids"]).logits
    labels = batch["shift_labels"]
    tok = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")  # [B, s]
    return module.trainer.strategy.token_mean(tok, batch["sample_weight"])


def _own_shift(module, batch) -> torch.Tensor:
    logits = module.model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten())


def _aux_on_shard_logits(module, batch) -> torch.Tensor:
    out = module.model(**batch)
    return out.loss * 0.5 + 0.01 * out.logits.float().pow(2).mean()


class StepModule(CausalLM):
    """A LightningModule whose ``training_step`` is one of ``STEPS``; ``manual``: manual optimization."""

    def __init__(self, case: dict) -> None:
        super().__init__(tiny_llama_config(num_kv_heads=2), lr=case.get("lr", 0.5), dataset=_dataset(case),
                         batch_size=case.get("batch_size", 1))
        self.case = case
        self.steps = 0
        self.automatic_optimization = not case.get("manual", False)
        if case.get("arch"):  # another architecture of tests/architectures.py (e.g. a hybrid with sequence mixers)
            from tests.support.architectures import build_model

            self.model = build_model(case["arch"])

    def train_dataloader(self) -> DataLoader:
        collate = pad_right_collate if self.case.get("data") == "padded" else None
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=collate)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        loss = STEPS[self.case["step"]](self, batch)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        if self.case.get("raw_backward"):  # what a one-device manual loop writes
            loss.backward()
        else:
            self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()


def _dataset(case: dict) -> Dataset:
    data = case.get("data", "tokens")
    if data == "padded":
        return VarLenDataset([16, 11, 13, 16, 9, 14, 16, 12])
    if data == "weighted":
        return WeightedRows(8, 16)
    if data == "packed":  # rows of 16 tokens packing 1-3 documents (position_ids restart at 0)
        from tests.support.models import PackedDataset

        return PackedDataset([[6, 10], [16], [3, 5, 8], [9, 7], [16], [4, 12], [11, 5], [8, 8]])
    return TokenDataset(case.get("num_rows", 8), case.get("seq_len", 16))


class Generation(Callback):
    """Greedy ``generate()`` from a prompt at the end of the first training batch, on every rank or on rank 0 only;
    also a plain copy of the model (the same weights, gathered under ZeRO-3) generating the same prompt."""

    def __init__(self, ranks: str) -> None:
        self.ranks = ranks
        self.tokens: Any = None
        self.plain_tokens: Any = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 0:
            return
        import deepspeed
        from transformers import LlamaForCausalLM

        model = pl_module.model
        with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=trainer.strategy.zero_stage_3):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        prompt = torch.tensor([[5, 17, 33, 2, 9, 41]])
        if self.ranks == "all" or trainer.is_global_zero:
            with torch.no_grad():
                self.tokens = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
            plain = LlamaForCausalLM(tiny_llama_config(num_kv_heads=2)).eval()
            plain.load_state_dict(state)
            with torch.no_grad():
                self.plain_tokens = plain.generate(prompt, max_new_tokens=6, do_sample=False).tolist()


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.model.named_parameters()}


def _fit(case: dict) -> dict:
    seed_everything(SEED, verbose=False)
    module = StepModule(case)
    initial = _weights(module) if case.get("stage", 2) != 3 else None
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    generation = Generation(case["generate"]) if case.get("generate") else None
    if generation is not None:
        callbacks.append(generation)
    strategy = UlyssesDeepSpeedStrategy(sp_size=case.get("sp_size", 2), stage=case.get("stage", 2),
                                        **case.get("strategy", {}))
    trainer = make_trainer(strategy, case.get("max_steps", 4), callbacks=callbacks, **case.get("trainer", {}))
    result: dict[str, Any] = {"error_type": None, "message": None}
    start = time.monotonic()
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on type and message
        result.update(error_type=type(err).__name__, message=str(err))
    result["seconds"] = time.monotonic() - start
    unchanged = None
    if initial is not None and result["error_type"] is not None:
        unchanged = all(torch.equal(initial[k], v) for k, v in _weights(module).items())
    result.update(
        steps=module.steps, global_step=trainer.global_step, losses=recorder.losses, weights_unchanged=unchanged,
        weights=recorder.weights if dist.get_rank() == 0 and recorder.weights else None,
        tokens=generation.tokens if generation else None, plain_tokens=generation.plain_tokens if generation else None,
    )
    return result


def run(payload: dict) -> dict:
    return run_cases(payload["cases"], _fit)

"""Paths on which SP peers could train on different data or lose the step state, through a real Trainer.

Run by ``tests/test_agreement.py`` as ``launch(2, "agreement:run", payload)`` (sp_size=2, so every
rank is an SP peer of the other). Each case reports the exception it ended with (type, message, seconds from the
start of ``fit``), how many training steps ran, the losses each rank saw (bit patterns, for exact comparisons) and
the fingerprints of the full batches the rank trained on.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, seed_everything
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, VOCAB, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import make_trainer, run_cases


class RankSplitStream(IterableDataset):
    """The usual DDP idiom: each *global* rank reads its own slice of the stream (wrong under SP)."""

    def __init__(self, rows_per_rank: list[int], lengths: list[int]) -> None:
        self.rows_per_rank, self.lengths = rows_per_rank, lengths

    def __iter__(self):
        rank = torch.distributed.get_rank()
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(self.rows_per_rank[rank]):
            row = torch.randint(1, VOCAB, (self.lengths[rank],), generator=g)
            yield {"input_ids": row, "labels": row.clone()}


class SameStreamPerRank(IterableDataset):
    """Every rank reads the same rows, but rank 0 reads one more (unequal batch counts)."""

    def __iter__(self):
        rank = torch.distributed.get_rank()
        g = torch.Generator().manual_seed(5)
        for _ in range(3 if rank == 0 else 2):
            row = torch.randint(1, VOCAB, (16,), generator=g)
            yield {"input_ids": row, "labels": row.clone()}


class RandomCrops(Dataset):
    """Random 16-token crops of longer rows, drawn with torch's RNG in the worker (random augmentation)."""

    def __init__(self) -> None:
        self.rows = torch.randint(1, VOCAB, (8, 64), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        start = int(torch.randint(0, 48, (1,)))
        row = self.rows[i, start:start + 16]
        return {"input_ids": row, "labels": row.clone()}


class Module(CausalLM):
    """``CausalLM`` with a configurable train loader and an optional batch-rebuilding hook; counts steps."""

    def __init__(self, case: dict) -> None:
        super().__init__(tiny_llama_config(), dataset=TokenDataset(8, 16), batch_size=1)
        self.case = case
        self.steps = 0

    def train_dataloader(self) -> DataLoader:
        loader = self.case.get("loader")
        if loader == "own_world_sampler":
            return DataLoader(self.dataset, batch_size=1, sampler=DistributedSampler(self.dataset))
        if loader == "own_dp_sampler":
            strategy = self.trainer.strategy
            return DataLoader(self.dataset, batch_size=1,
                              sampler=DistributedSampler(self.dataset, num_replicas=strategy.dp_size,
                                                         rank=strategy.dp_rank))
        if loader == "stream_equal":
            return DataLoader(RankSplitStream([4, 4], [16, 16]), batch_size=1)
        if loader == "stream_lengths":
            return DataLoader(RankSplitStream([4, 4], [16, 12]), batch_size=1)
        if loader == "stream_counts":
            return DataLoader(SameStreamPerRank(), batch_size=1)
        if loader == "crops_seeded_workers":  # seed_everything(workers=True): Lightning adds the worker_init_fn
            return DataLoader(RandomCrops(), batch_size=1, num_workers=1)
        if loader == "crops_global_rank_init":  # what Lightning alone would install: seeds by global rank
            from lightning.fabric.utilities.seed import pl_worker_init_function

            return DataLoader(RandomCrops(), batch_size=1, num_workers=1,
                              worker_init_fn=partial(pl_worker_init_function, rank=torch.distributed.get_rank()))
        if loader == "mask_4d":  # a collate that builds a custom [B, 1, S, S] mask
            def collate(samples):
                batch = torch.utils.data.default_collate(samples)
                S = batch["input_ids"].shape[1]
                batch["attention_mask"] = torch.ones(len(samples), 1, S, S).tril()
                return batch

            return DataLoader(self.dataset, batch_size=1, collate_fn=collate)
        if loader == "packed":
            from tests.support.models import PackedDataset

            return DataLoader(PackedDataset([[6, 10], [8, 8], [16], [4, 12]]), batch_size=1)
        if loader == "unbatched":
            return DataLoader(self.dataset, batch_size=None)
        return super().train_dataloader()

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.case.get("rebuild_batch"):  # a user hook that rebuilds the dict from the keys it knows
            return {key: batch[key] for key in ("input_ids", "labels", "shift_labels", "position_ids")}
        return batch

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


class NoAttentionLM(Module):
    """A LightningModule whose model has no attention at all (embedding + linear): nothing for SP to switch."""

    def __init__(self, case: dict) -> None:
        super().__init__(case)
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))

    def training_step(self, batch, batch_idx):
        self.steps += 1
        logits = self.model(batch["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())


class HalvesDataset(Dataset):
    """Rows whose first half holds token ids below VOCAB / 2 and whose second half ids from VOCAB / 2 up: at sp=2
    rank 0's shard has only the low ids, rank 1's only the high ones."""

    def __init__(self, rows: int = 8, length: int = 16) -> None:
        g = torch.Generator().manual_seed(11)
        self.rows = torch.cat([torch.randint(1, VOCAB // 2, (rows, length // 2), generator=g),
                               torch.randint(VOCAB // 2, VOCAB, (rows, length - length // 2), generator=g)], dim=1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


class TokenRoutedExperts(torch.nn.Module):
    """An MoE MLP with one module per expert, routing each token by its id (low ids to expert 0, high to 1), as user
    MoE code often loops: ``skip_empty`` leaves out an expert no token of the call is routed to (its weights are then
    not in the graph), otherwise every expert runs, on an empty slice where it has no token."""

    def __init__(self, hidden: int, skip_empty: bool) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.skip_empty = skip_empty
        self.token_ids: torch.Tensor = torch.zeros(0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, s, H] -> [B, s, H]
        route = (self.token_ids >= VOCAB // 2).long().reshape(-1)  # [B*s]
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(route == e).squeeze(1)
            if self.skip_empty and rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.view_as(hidden)


class ExpertsByTokenLM(Module):
    """The tiny Llama with layer 0's MLP replaced by :class:`TokenRoutedExperts` (``case["skip_empty"]``), trained
    on :class:`HalvesDataset`: under SP=2 each rank's shard reaches one expert only."""

    def __init__(self, case: dict) -> None:
        super().__init__(case)
        self.dataset = HalvesDataset()
        experts = TokenRoutedExperts(self.model.config.hidden_size, case.get("skip_empty", False))
        self.model.model.layers[0].mlp = experts

        def keep_ids(module, args, kwargs):
            experts.token_ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]

        self.model.model.register_forward_pre_hook(keep_ids, with_kwargs=True)


class IteratorStepLM(Module):
    """A training_step that pulls batches itself (Lightning's `dataloader_iter` mode)."""

    def training_step(self, dataloader_iter):
        self.steps += 1
        batch = next(dataloader_iter)
        return self.model(**batch).loss


class FullBatchRecorder(Callback):
    """Loss bit patterns per step, and the fingerprint of every full batch this rank trained on."""

    def __init__(self) -> None:
        self.loss_bits: list[int] = []
        self.fingerprints: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.fingerprints.append(trainer.strategy.current_shard_info.fingerprint)  # the step's batch (set in the step)
        self.loss_bits.append(outputs["loss"].detach().float().view(torch.int32).item())


def _fit(case: dict) -> dict:
    seed_everything(SEED, workers=case.get("seed_workers", False), verbose=False)
    module = {"no_attention": NoAttentionLM, "dataloader_iter": IteratorStepLM,
              "experts_by_token": ExpertsByTokenLM}.get(case.get("module"), Module)(case)
    recorder = FullBatchRecorder()
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=case.get("stage", 2), **case.get("strategy", {}))
    trainer = make_trainer(strategy, case.get("max_steps", 4), callbacks=[recorder], **case.get("trainer", {}))
    result: dict[str, Any] = {"error_type": None, "message": None}
    start = time.monotonic()
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on the type
        import traceback

        result.update(error_type=type(err).__name__, message=str(err), traceback=traceback.format_exc())
    result.update(seconds=time.monotonic() - start, steps=module.steps, loss_bits=recorder.loss_bits,
                  fingerprints=recorder.fingerprints, global_step=trainer.global_step,
                  weights={k: v.detach().float().clone() for k, v in module.model.named_parameters()}
                  if case.get("stage", 2) != 3 and case.get("module") is None else None)
    os.environ.pop("PL_SEED_WORKERS", None)
    return result


def run(payload: dict) -> dict:
    return run_cases(payload["cases"], _fit)

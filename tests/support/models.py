"""Tiny models and data shared by the scenarios (run in worker processes) and the single-device references."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

VOCAB = 128
SEED = 1234


def tiny_llama_config(num_kv_heads: int = 4, num_heads: int = 4, attn: str = "sdpa", layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16 * num_heads,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        attn_implementation=attn,
        pad_token_id=0,
    )


def build_llama(config, init_seed: int = 0):
    """The causal LM of ``config`` (a Llama, or any other family's config), seeded."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(init_seed)
    if type(config) is LlamaConfig:
        return LlamaForCausalLM(config)
    return AutoModelForCausalLM.from_config(config)


def tiny_qwen3_config():
    """A Qwen3 decoder of the tiny Llama's size: query/key norms, GQA 4/2, head size 16."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       attn_implementation="sdpa", pad_token_id=0, tie_word_embeddings=False)


class TokenDataset(Dataset):
    """Random token rows, the same on every process (seeded); labels = input_ids (HF shifts them)."""

    def __init__(self, num_rows: int, seq_len: int, seed: int = 7, ignore_after: Optional[int] = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(1, VOCAB, (num_rows, seq_len), generator=g)
        self.labels = self.rows.clone()
        if ignore_after is not None:  # e.g. a prompt-only tail: no targets past this position
            self.labels[:, ignore_after:] = -100

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


class CausalLM(LightningModule):
    """The LightningModule a user writes, unchanged for sequence parallelism."""

    def __init__(self, config, lr: float = 0.5, init_seed: int = 0, dataset: Optional[Dataset] = None,
                 batch_size: int = 1) -> None:
        super().__init__()
        self.model = build_llama(config, init_seed)
        self.lr = lr
        self.dataset = dataset
        self.batch_size = batch_size

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("test_loss", loss, sync_dist=True)
        return loss

    optimizer_name = "sgd"  # "adam": torch.optim.Adam (tests/test_bf16.py)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


def lightning_order(num_rows: int, seed: int = SEED) -> list[int]:
    """The sample order Lightning's injected DistributedSampler (shuffle=True, seed=global seed) gives in epoch 0."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_rows, generator=g).tolist()


def train_single_device(config, dataset: TokenDataset, global_batch: int, steps: int, lr: float = 0.5,
                        init_seed: int = 0, clip_norm: Optional[float] = None) -> dict[str, Any]:
    """The reference: plain PyTorch + transformers on one process, SGD, the same sample order as Lightning."""
    model = build_llama(config, init_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = lightning_order(len(dataset))
    losses = []
    for step in range(steps):
        rows = [dataset[i] for i in order[step * global_batch:(step + 1) * global_batch]]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch).loss
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


class OwnLossCausalLM(CausalLM):
    """A user who computes the loss from logits, with the strategy's documented helper."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        logits = self.model(**inputs).logits
        loss = self.trainer.strategy.cross_entropy(logits, batch["shift_labels"])
        self.log("train_loss", loss, sync_dist=True)
        return loss


class VarLenDataset(Dataset):
    """Rows of different lengths (seeded); labels = input_ids."""

    def __init__(self, lengths: list[int], seed: int = 11) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


class PackedDataset(Dataset):
    """Rows that pack several documents each; ``position_ids`` restart at 0 at every document start."""

    def __init__(self, documents_per_row: list[list[int]], seed: int = 13) -> None:
        g = torch.Generator().manual_seed(seed)
        self.documents = [[torch.randint(1, VOCAB, (n,), generator=g) for n in row] for row in documents_per_row]

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        docs = self.documents[i]
        input_ids = torch.cat(docs)
        return {"input_ids": input_ids, "labels": input_ids.clone(),
                "position_ids": torch.cat([torch.arange(len(d)) for d in docs])}


def pad_right_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user's collate: right-pad to the longest row; pads get label -100 and attention_mask 0."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
             "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
             "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["labels"][row, :n] = sample["labels"]
        batch["attention_mask"][row, :n] = 1
    return batch


def documents_as_rows(dataset: PackedDataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """The reference for packing: the same documents, each its own (right-padded) row."""
    docs = [d for i in indices for d in dataset.documents[i]]
    return pad_right_collate([{"input_ids": d, "labels": d.clone()} for d in docs])


class DataCausalLM(CausalLM):
    """CausalLM with a given collate, a corpus-level validation loss and a predict_step returning logits."""

    def __init__(self, config, dataset, batch_size: int = 1, collate_fn=None, lr: float = 0.5) -> None:
        super().__init__(config, lr=lr, dataset=dataset, batch_size=batch_size)
        from lightning_ulysses.evaluation.metrics import TokenWeightedLoss, TokenWeightedPerplexity

        self.collate_fn = collate_fn
        self.corpus_loss = TokenWeightedLoss()
        self.corpus_perplexity = TokenWeightedPerplexity()

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val_loss", loss, sync_dist=True)
        self.corpus_loss.update(loss, batch["shift_labels"])
        self.corpus_perplexity.update(loss, batch["shift_labels"])
        self.log("val_corpus_loss", self.corpus_loss)
        self.log("val_perplexity", self.corpus_perplexity)
        return loss

    def predict_step(self, batch, batch_idx):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        return self.model(**inputs).logits

    def _loader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


def sgd_steps(model, batches: list[dict[str, torch.Tensor]], lr: float) -> dict:
    """Single-device SGD on ``model``'s trainable parameters, one optimizer step per given full batch; returns the
    losses and every parameter after the last step."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def train_on_batches(config, batches: list[dict[str, torch.Tensor]], lr: float = 0.5, init_seed: int = 0):
    """Single-device SGD of a fresh tiny Llama, one optimizer step per given full batch; returns losses, weights and
    the model."""
    model = build_llama(config, init_seed)
    return {**sgd_steps(model, batches, lr), "model": model}


RING_PASSES = {"n": 0}  # point-to-point passes of K/V blocks around the ring (counted by count_ring_passes)


def count_ring_passes() -> None:
    """Count ring attention's point-to-point passes in ``RING_PASSES`` (CommDebugMode does not see them)."""
    from lightning_ulysses.parallel import ring

    if getattr(ring._start_pass, "_counted", False):
        return
    original = ring._start_pass

    def counted(tensors, group):
        RING_PASSES["n"] += 1
        return original(tensors, group)

    counted._counted = True
    ring._start_pass = counted


class CountingCausalLM(CausalLM):
    """``CausalLM`` that counts its training steps, its Hugging Face model's forward calls and losses, and the
    collectives of its first step: the model's forward inside ``training_step`` (not the loss logging), backward
    around ``engine.backward``, ring passes when :func:`count_ring_passes` is on."""

    def __init__(self, config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.steps = 0
        self.forwards = 0
        self.losses: list[float] = []
        self.forward_counts: dict[str, int] = {}
        self.backward_counts: dict[str, int] = {}
        self._backward_mode = None
        self.model.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module, args) -> None:
        self.forwards += 1

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.debug import CommDebugMode

        self.steps += 1
        if batch_idx > 0 or self.forward_counts:
            loss = self.model(**batch).loss
        else:
            passes_before = RING_PASSES["n"]
            with CommDebugMode() as comm:
                loss = self.model(**batch).loss
            self.forward_counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
            if RING_PASSES["n"] > passes_before:
                self.forward_counts["ring_passes"] = RING_PASSES["n"] - passes_before
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(loss.item())
        return loss

    def on_before_backward(self, loss):
        from torch.distributed.tensor.debug import CommDebugMode

        if not self.backward_counts and self._backward_mode is None:
            self._backward_mode = CommDebugMode()
            self._backward_mode.__enter__()
            self._passes_before_backward = RING_PASSES["n"]

    def on_after_backward(self):
        if self._backward_mode is not None:
            self._backward_mode.__exit__(None, None, None)
            self.backward_counts = {str(op).split(".")[-1]: n
                                    for op, n in self._backward_mode.get_comm_counts().items()}
            if RING_PASSES["n"] > self._passes_before_backward:
                self.backward_counts["ring_passes"] = RING_PASSES["n"] - self._passes_before_backward
            self._backward_mode = None

"""A compact GPT written from scratch (nanoGPT style) trained with Ulysses sequence parallelism.

The model knows nothing about sequence parallelism. The only declaration is which module is the attention core:

    UlyssesDeepSpeedStrategy(sp_size=2, attention_modules=[AttentionCore])

The strategy wraps every ``AttentionCore`` so that it receives this rank's sequence shard of q, k, v and runs on the
full sequence for its share of the heads (any head count: 6 heads at sp 4 split 2/2/1/1). Positions come from the
batch's ``position_ids`` (global positions of the shard, added by the strategy's collate step), and the loss from
``strategy.cross_entropy`` (the mean over the whole batch, exact gradients).

    python examples/gpt_from_scratch.py                 # CPU: 2 processes, sp_size=2
    python examples/gpt_from_scratch.py --heads 3       # uneven heads
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from lightning_ulysses import StepProgressBar, UlyssesDeepSpeedStrategy


@dataclass
class GPTConfig:
    vocab_size: int = 258
    max_seq_len: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 128


class AttentionCore(nn.Module):
    """Causal attention on ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` -> ``[B, H, T, D]``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # T: this rank's shard under SP
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                     self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v)  # [B, H, T, D]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:  # one device: 0..T-1; under the strategy it passes the shard's global positions
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)  # global positions, also on a shard
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, V]


class GPTModule(LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float = 3e-3, optimizer: str = "adamw") -> None:
        super().__init__()
        self.gpt, self.lr, self.optimizer_name = GPT(cfg), lr, optimizer

    def training_step(self, batch, batch_idx):
        logits = self.gpt(batch["input_ids"], batch["position_ids"])
        loss = self.trainer.strategy.cross_entropy(logits, batch["shift_labels"])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from train_long_context import StdlibCodeDataset  # the same byte-level stdlib corpus as the main example

    seed_everything(0)
    cfg = GPTConfig(max_seq_len=args.seq_len, n_head=args.heads, n_kv_head=args.heads, n_embd=32 * args.heads)
    data = torch.utils.data.DataLoader(StdlibCodeDataset(args.seq_len, 4 << 20), batch_size=1, shuffle=True)
    trainer = Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage, attention_modules=[AttentionCore]),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[StepProgressBar()],  # the bar shows steps out of max_steps
    )
    trainer.fit(GPTModule(cfg), data)


if __name__ == "__main__":
    main()

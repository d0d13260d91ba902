"""DPO on long preference pairs with Ulysses sequence parallelism: a policy and its frozen reference, both sharded.

    python examples/dpo.py                        # CPU: 2 processes, sp_size=2, ZeRO 2, about a minute
    python examples/dpo.py --stage 3 --loss ipo   # ZeRO 3; IPO instead of DPO's sigmoid loss
    torchrun --nproc_per_node=2 examples/dpo.py

The data is made here, nothing downloaded: each pair shares a prompt (a slice of the Python standard library's
source, byte-level tokens) and continues it with the real next bytes ("chosen") or with the same bytes shuffled
("rejected"). Rows are ``[chosen..., rejected...]``, right-padded, prompts labelled -100.

What is specific to sequence parallelism is two lines of ``training_step``: a sequence's log-probability is
``strategy.sequence_sum(token_logps, mask)``, the sum over the whole sequence, the same on every rank (the one-device
``(logps * mask).sum(-1)`` would sum this rank's shard only), and the token log-probabilities line up with
``batch["shift_labels"]`` (the next-token targets the strategy built before cutting the sequence). Everything else is
DPO as TRL writes it. A loss written over the shard alone is stopped before any weight changes
(docs/post-training.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy

PAD = 256
OUT_DIR = Path(__file__).resolve().parent / "out" / "dpo"


def parse_args(argv=None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if gpu else 2)
    p.add_argument("--sp-size", type=int, default=2, help="ranks per sequence")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo"], help="DPO's sigmoid loss or IPO")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--pairs", type=int, default=32, help="preference pairs")
    p.add_argument("--batch-pairs", type=int, default=2, help="pairs per step per data-parallel replica")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-len", type=int, default=256, help="longest sequence (prompt + completion)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--lr", type=float, default=None,
                   help="SGD learning rate (default 0.05 for DPO, 0.002 for IPO: its squared loss takes larger steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 0.002 if args.loss == "ipo" else 0.05
    return args


# ------------------------------------------------------------------------------------------------ data and model
def preference_pairs(args: argparse.Namespace) -> list[tuple[list[int], list[int], int]]:
    """``(chosen, rejected, prompt_len)`` byte sequences: a prompt continued by the real bytes or by them shuffled."""
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()
    g = torch.Generator().manual_seed(args.seed)
    pairs = []
    for _ in range(args.pairs):
        length = int(torch.randint(args.max_len // 2, args.max_len + 1, (1,), generator=g))
        start = int(torch.randint(0, len(text) - length, (1,), generator=g))
        chosen = list(text[start:start + length])
        completion = chosen[args.prompt_len:]
        shuffled = [completion[i] for i in torch.randperm(len(completion), generator=g).tolist()]
        pairs.append((chosen, chosen[:args.prompt_len] + shuffled, args.prompt_len))
    return pairs


def collate(pairs: list[tuple[list[int], list[int], int]]) -> dict[str, torch.Tensor]:
    """``2B`` right-padded rows, chosen first; prompt and padding labelled -100."""
    rows = [(chosen, prompt) for chosen, _, prompt in pairs] + [(rejected, prompt) for _, rejected, prompt in pairs]
    longest = max(len(r) for r, _ in rows)
    batch = {"input_ids": torch.full((len(rows), longest), PAD), "labels": torch.full((len(rows), longest), -100),
             "attention_mask": torch.zeros(len(rows), longest, dtype=torch.long)}
    for i, (tokens, prompt) in enumerate(rows):
        batch["input_ids"][i, :len(tokens)] = torch.tensor(tokens)
        batch["labels"][i, prompt:len(tokens)] = torch.tensor(tokens[prompt:])
        batch["attention_mask"][i, :len(tokens)] = 1
    return batch


def build_policy(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=PAD + 1, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=PAD, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, s]`` log-probabilities of the targets (any value where the target is -100: masked later)."""
    return torch.gather(logits.float().log_softmax(-1), -1, targets.clamp(min=0)[..., None]).squeeze(-1)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, kind: str) -> torch.Tensor:
    """TRL's losses from the per-pair log-ratios ``log π/π_ref`` of the chosen and rejected sequences."""
    logits = chosen - rejected
    if kind == "ipo":
        return ((logits - 1 / (2 * beta)) ** 2).mean()
    return -F.logsigmoid(beta * logits).mean()


class DPO(LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.policy = build_policy(args.seed)
        self.ref = build_policy(args.seed).requires_grad_(False).eval()  # the frozen reference: the initial policy
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(preference_pairs(self.args), batch_size=self.args.batch_pairs, collate_fn=collate)

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        targets = batch["shift_labels"]  # next-token targets of this rank's shard, -100 on prompts and padding
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        policy = strategy.sequence_sum(token_logps(logits, targets))  # [2B]: whole sequences' log-probabilities
        with torch.no_grad():
            ref_logits = self.ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            reference = strategy.sequence_sum(token_logps(ref_logits, targets))
        chosen, rejected = (policy - reference).chunk(2)
        loss = dpo_loss(chosen, rejected, self.args.beta, self.args.loss)
        margin = (chosen - rejected).detach().mean()
        self.log_dict({"loss": loss, "margin": margin}, prog_bar=True, sync_dist=False)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=self.args.lr)


def main(argv=None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed, verbose=False)
    module = DPO(args)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(accelerator=accelerator, devices=args.devices, max_steps=args.steps, logger=False,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage),
                      enable_checkpointing=False, enable_model_summary=False, precision="32-true")
    trainer.fit(module)
    if trainer.is_global_zero:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "losses.json").write_text(json.dumps({"loss": module.losses}))
        print(f"DPO ({args.loss}) sp_size={args.sp_size}, world_size={trainer.world_size}, ZeRO {args.stage}:"
              f" loss {module.losses[0]:.4f} -> {module.losses[-1]:.4f} over {len(module.losses)} steps")


if __name__ == "__main__":
    main()

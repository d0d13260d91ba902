"""A GRPO-style policy-gradient loss on pre-generated rollouts, with Ulysses sequence parallelism.

    python examples/grpo_loss.py                           # CPU: 2 processes, sp_size=2, ZeRO 2, about a minute
    python examples/grpo_loss.py --normalise token         # token-level normalisation (DAPO) instead of GRPO's
    python examples/grpo_loss.py --stage 3

1. **Rollouts** (before training, plain generation, the same on every rank): prompts are slices of the Python standard
   library's source (byte-level tokens); the initial policy samples ``--group`` completions per prompt. A rule scores
   each completion (the share of lowercase letters), and advantages are normalised within each prompt's group (GRPO).
   The rollout policy's token log-probabilities are kept as ``old_logps`` (``old_logps[b, i]``: token ``i + 1``, so
   they line up with the targets and are sharded with the batch).
2. **Training** with the clipped surrogate and a k3 KL term to the frozen reference (the initial policy).
   - ``--normalise sequence`` (GRPO): each completion's mean over its tokens, ``strategy.sequence_mean``, then the
     mean over completions.
   - ``--normalise token`` (DAPO): one mean over all completion tokens of the batch, ``strategy.token_mean``.

   Both reduce over the whole sequence, the same on every rank; a mean over this rank's shard alone would be stopped
   before any weight changes (docs/post-training.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy

PAD = 256
OUT_DIR = Path(__file__).resolve().parent / "out" / "grpo_loss"


def parse_args(argv=None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if gpu else 2)
    p.add_argument("--sp-size", type=int, default=2, help="ranks per sequence")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--normalise", default="sequence", choices=["sequence", "token"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64, help="longest completion")
    p.add_argument("--batch-size", type=int, default=4, help="rollouts per step per data-parallel replica")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--kl-beta", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    return p.parse_args(argv)


def build_policy(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=PAD + 1, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=PAD, eos_token_id=None, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the targets (any value where the target is -100: masked later)."""
    return torch.gather(logits.float().log_softmax(-1), -1, targets.clamp(min=0)[..., None]).squeeze(-1)


@torch.no_grad()
def rollouts(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """Sampled completions of the initial policy with rewards, group-normalised advantages and old log-probs."""
    policy = build_policy(args.seed).eval()
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes()
    g = torch.Generator().manual_seed(args.seed)
    samples = []
    for _ in range(args.prompts):
        start = int(torch.randint(0, len(text) - args.prompt_len, (1,), generator=g))
        prompt = torch.tensor(list(text[start:start + args.prompt_len]))[None]
        group = []
        for _ in range(args.group):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
            new = int(torch.randint(args.max_new // 2, args.max_new + 1, (1,), generator=g))
            row = policy.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                                  pad_token_id=PAD)[0]
            completion = row[args.prompt_len:]
            reward = float(((completion >= ord("a")) & (completion <= ord("z"))).float().mean())
            logits = policy(input_ids=row[None]).logits[0, :-1]
            old = torch.zeros(len(row))
            old[:-1] = token_logps(logits, row[1:])  # position i: the log-probability of token i + 1
            group.append({"input_ids": row, "reward": reward, "old_logps": old})
        rewards = torch.tensor([s["reward"] for s in group])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for sample, advantage in zip(group, advantages.tolist()):
            samples.append({**sample, "advantage": advantage, "prompt_len": args.prompt_len})
    return samples


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(s["input_ids"]) for s in samples)
    n = len(samples)
    batch = {"input_ids": torch.full((n, longest), PAD), "labels": torch.full((n, longest), -100),
             "attention_mask": torch.zeros(n, longest, dtype=torch.long), "old_logps": torch.zeros(n, longest),
             "advantages": torch.tensor([s["advantage"] for s in samples])}
    for i, s in enumerate(samples):
        length, prompt = len(s["input_ids"]), s["prompt_len"]
        batch["input_ids"][i, :length] = s["input_ids"]
        batch["labels"][i, prompt:length] = s["input_ids"][prompt:]
        batch["attention_mask"][i, :length] = 1
        batch["old_logps"][i, :length] = s["old_logps"]
    return batch


def per_token_objective(policy: torch.Tensor, old: torch.Tensor, reference: torch.Tensor, advantages: torch.Tensor,
                        clip: float, kl_beta: float) -> torch.Tensor:
    """``[B, T]`` GRPO per-token loss: the clipped surrogate and the k3 KL estimate to the reference."""
    ratio = torch.exp(policy - old)
    adv = advantages[:, None]
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    kl = torch.exp(reference - policy) - (reference - policy) - 1
    return -(surrogate - kl_beta * kl)


class GRPOLoss(LightningModule):
    def __init__(self, args: argparse.Namespace, samples: list[dict]) -> None:
        super().__init__()
        self.args, self.samples = args, samples
        self.policy = build_policy(args.seed)
        self.ref = build_policy(args.seed).requires_grad_(False).eval()
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.args.batch_size, collate_fn=collate)

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        targets = batch["shift_labels"]  # this rank's next-token targets; -100 on prompts and padding
        mask = targets != -100  # the completion tokens of this rank's shard
        policy = token_logps(self.policy(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).logits, targets)
        with torch.no_grad():
            reference = token_logps(self.ref(input_ids=batch["input_ids"],
                                             attention_mask=batch["attention_mask"]).logits, targets)
        per_token = per_token_objective(policy, batch["old_logps"], reference, batch["advantages"], self.args.clip,
                                        self.args.kl_beta)
        if self.args.normalise == "sequence":
            loss = strategy.sequence_mean(per_token, mask).mean()  # each completion's mean, then over completions
        else:
            loss = strategy.token_mean(per_token, mask=mask)  # one mean over the batch's completion tokens
        self.log("loss", loss, prog_bar=True)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=self.args.lr)


def main(argv=None) -> None:
    args = parse_args(argv)
    samples = rollouts(args)
    seed_everything(args.seed, verbose=False)
    module = GRPOLoss(args, samples)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(accelerator=accelerator, devices=args.devices, max_steps=args.steps, logger=False,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage),
                      enable_checkpointing=False, enable_model_summary=False, precision="32-true")
    trainer.fit(module)
    if trainer.is_global_zero:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "losses.json").write_text(json.dumps({"loss": module.losses}))
        torch.save(samples, args.out_dir / "rollouts.pt")  # the data it trained on
        mean_reward = sum(s["reward"] for s in samples) / len(samples)
        print(f"GRPO loss ({args.normalise} normalisation) sp_size={args.sp_size}, world_size={trainer.world_size},"
              f" ZeRO {args.stage}: {len(samples)} rollouts, mean reward {mean_reward:.3f}; loss"
              f" {module.losses[0]:.4f} -> {module.losses[-1]:.4f} over {len(module.losses)} steps")


if __name__ == "__main__":
    main()

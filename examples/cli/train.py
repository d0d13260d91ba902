"""The long-context example as a LightningCLI: every Trainer, strategy, model and data argument from flags or YAML.

The model and data are those of ``examples/train_long_context.py`` (a randomly initialized Llama trained on the
Python standard library's own source, byte tokens, nothing downloaded); the strategy is chosen on the command line.
Run from the repository root:

    python examples/cli/train.py fit --config examples/cli/config.yaml                 # CPU: 2 processes, sp_size=2
    python examples/cli/train.py fit --config examples/cli/config.yaml --trainer.strategy.stage=3 --data.seq_len=4096
    python examples/cli/train.py fit --trainer.strategy=UlyssesDeepSpeedStrategy --trainer.strategy.sp_size=2 \\
        --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=20               # flags only, no YAML
    python examples/cli/train.py fit --config examples/cli/config.yaml --print_config       # the resolved config
    python examples/cli/train.py fit --trainer.strategy.help UlyssesDeepSpeedStrategy      # strategy args + types
    torchrun --nproc_per_node=2 examples/cli/train.py fit --config examples/cli/config.yaml
    # GPUs: add --config examples/cli/gpu.yaml; SLURM: examples/slurm/train.sbatch

Strategy forms that work with LightningCLI (jsonargparse):

* ``--trainer.strategy=UlyssesDeepSpeedStrategy --trainer.strategy.sp_size=2`` (short class name; the package is
  imported below, which makes the class known) or the full ``lightning_ulysses.UlyssesDeepSpeedStrategy``;
* YAML ``trainer.strategy: {class_path: lightning_ulysses.UlyssesDeepSpeedStrategy, init_args: {sp_size: 2}}``;
* a registry name alone: ``--trainer.strategy=ulysses_deepspeed_stage_3`` (``sp_size=None``: all devices of a node).
  A registry name takes no ``--trainer.strategy.<arg>`` flags: jsonargparse resolves those only on a class.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the model and data of train_long_context

from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.callbacks import ProgressBar  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_ulysses  # noqa: E402,F401  (registers the strategy names; makes the class resolvable by name)
from lightning_ulysses import SequenceParallelThroughputMonitor  # noqa: E402
from train_long_context import BOS, PAD, THROUGHPUT_WINDOW, VOCAB_SIZE, StdlibCodeDataset  # noqa: E402


class LongContextLM(LightningModule):
    """A causal LM over byte tokens. Nothing in it is specific to sequence parallelism.

    Args:
        seq_len: Tokens per sequence (linked from ``data.seq_len``; sets the model's position range).
        hidden_size: Model width of the randomly initialized Llama.
        layers: Decoder layers.
        heads: Attention heads (``sp_size`` must divide them).
        kv_heads: Key/value heads (GQA).
        lr: AdamW peak learning rate (linear warmup over 10% of the steps, then cosine decay to 10%).
        model_path: A LOCAL Hugging Face checkpoint to fine-tune instead (vocabulary of at least 258 entries).
    """

    def __init__(
        self,
        seq_len: int = 2048,
        hidden_size: int = 128,
        layers: int = 4,
        heads: int = 4,
        kv_heads: int = 2,
        lr: float = 5e-3,
        model_path: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForCausalLM, LlamaConfig

        if model_path:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa")
            if self.model.config.vocab_size < VOCAB_SIZE:
                raise ValueError(f"model_path: vocab_size {self.model.config.vocab_size} < {VOCAB_SIZE} byte tokens.")
        else:
            config = LlamaConfig(
                vocab_size=VOCAB_SIZE,
                hidden_size=hidden_size,
                intermediate_size=3 * hidden_size,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=seq_len,
                pad_token_id=PAD,
                bos_token_id=BOS,
                eos_token_id=BOS,
            )
            self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, betas=(0.9, 0.95))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, total // 10)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_callbacks(self):
        # global tokens/s (each sample's tokens counted once), logged with the other metrics
        return [SequenceParallelThroughputMonitor(window_size=THROUGHPUT_WINDOW)]


class StdlibCodeData(LightningDataModule):
    """Rows of ``seq_len`` byte tokens from the standard library's ``.py`` files (full sequences: the strategy
    shards them).

    Args:
        seq_len: Tokens per sequence.
        batch_size: Sequences per step per data-parallel replica.
        corpus_mb: How much of the standard library's source to read (MiB).
    """

    def __init__(self, seq_len: int = 2048, batch_size: int = 1, corpus_mb: int = 8) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.corpus_mb = corpus_mb
        self.dataset: Optional[StdlibCodeDataset] = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            self.dataset = StdlibCodeDataset(self.seq_len, max_bytes=self.corpus_mb * 2**20)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


class UlyssesCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")

    def instantiate_trainer(self, **kwargs):
        """The progress bar shows optimizer steps out of ``max_steps`` (``StepProgressBar``) unless the bar is off
        (``--trainer.enable_progress_bar=false``) or another progress bar is configured."""
        config = (self.config_init[self.subcommand] if self.subcommand else self.config_init)["trainer"]
        callbacks = list(config.get("callbacks") or [])
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, lightning_ulysses.StepProgressBar()]
        return super().instantiate_trainer(**kwargs)


def main(args=None, run: bool = True) -> UlyssesCLI:
    """``args=None`` reads ``sys.argv``; ``run=False`` only builds the model, data and Trainer (no subcommand)."""
    return UlyssesCLI(LongContextLM, StdlibCodeData, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()

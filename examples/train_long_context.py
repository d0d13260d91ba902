"""Train a small Llama on long sequences of real code with Ulysses sequence parallelism (Lightning + DeepSpeed).

The corpus is the Python standard library's own ``.py`` files (found with ``sysconfig``; nothing is downloaded),
tokenized as bytes (ids 0..255, 256 = pad, 257 = bos/eos) and cut into rows of ``--seq-len`` tokens. The model is a
randomly initialized ``LlamaForCausalLM`` built from a config (sdpa attention). Each sequence is split over
``--sp-size`` processes; the LightningModule below is exactly what you would write for a single device.

    python examples/train_long_context.py                    # CPU: 2 processes, sp_size=2, about a minute
    python examples/train_long_context.py --seq-len 4096     # longer sequences, same activation memory per rank
    torchrun --nproc_per_node=2 examples/train_long_context.py
    python examples/train_long_context.py --model-path /path/to/local/hf/checkpoint   # GPU: a real model

Without a GPU it runs on CPU with 2 processes (Lightning launches the second one by re-running this script); with
GPUs it uses all of them, bf16-mixed precision and longer sequences. ``--model-path`` loads a LOCAL Hugging Face
checkpoint (``AutoModelForCausalLM.from_pretrained``) with its own config instead of the random tiny model; the byte
tokens are fed to it as they are, so its vocabulary must have at least 258 entries.
"""

import argparse
import math
import os
import sysconfig
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses import SequenceParallelThroughputMonitor, StepProgressBar, UlyssesDeepSpeedStrategy

PAD, BOS = 256, 257  # byte-level vocabulary: 0..255 are the bytes themselves
VOCAB_SIZE = 258
OUT_DIR = Path(__file__).resolve().parent / "out"
THROUGHPUT_WINDOW = 10  # steps over which the throughput monitor measures tokens/s

for _noise in (".*does not have many workers.*", ".*LeafSpec.*", ".*all_gather_into_tensor.*",
               ".*flops_per_batch.*"):  # the throughput monitor counts tokens, not FLOPs
    warnings.filterwarnings("ignore", _noise)


class StdlibCodeDataset(Dataset):
    """Rows of ``seq_len`` byte tokens from the standard library's source files, concatenated in sorted order."""

    def __init__(self, seq_len: int, max_bytes: int) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
        chunks, total = [], 0
        for path in files:  # each file: <bos> followed by its bytes
            data = path.read_bytes()
            if not data:
                continue
            chunks.append(torch.tensor([BOS], dtype=torch.int16))
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
            total += len(data) + 1
            if total >= max_bytes:
                break
        tokens = torch.cat(chunks)
        num_rows = len(tokens) // seq_len
        if num_rows == 0:
            raise ValueError(f"The corpus ({len(tokens)} tokens) is shorter than one sequence of {seq_len} tokens.")
        self.rows = tokens[: num_rows * seq_len].view(num_rows, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = self.rows[i].long()
        return {"input_ids": ids, "labels": ids.clone()}  # the strategy shifts the labels and shards the sequence


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, attn_implementation="sdpa")
        if model.config.vocab_size < VOCAB_SIZE:
            raise ValueError(f"--model-path: vocab_size {model.config.vocab_size} < {VOCAB_SIZE} byte tokens.")
        return model
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=BOS,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


class CausalLM(LightningModule):
    """A plain causal-LM LightningModule: nothing in it is specific to sequence parallelism."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = build_model(args)
        self.dataset = None  # built on first use (Lightning asks for the DataLoader more than once)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01, betas=(0.9, 0.95))
        warmup = max(1, self.args.max_steps // 10)

        def schedule(step: int) -> float:  # linear warmup, then cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.args.max_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        if self.dataset is None:
            self.dataset = StdlibCodeDataset(self.args.seq_len, max_bytes=self.args.corpus_mb * 2**20)
        return DataLoader(self.dataset, batch_size=self.args.batch_size, shuffle=True, drop_last=True)


class TrainingSummary(Callback):
    """Prints one line at the end of training: the loss at the start and the end, and the global throughput that
    :class:`~lightning_ulysses.SequenceParallelThroughputMonitor` measured (tokens of the full sequences per second,
    each sample counted once, not once per SP rank)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero and self.losses:
            metrics = trainer.logged_metrics  # the monitor's last window; "train/items_per_sec" exists when dp > 1
            rate = metrics.get("train/items_per_sec", metrics.get("train/device/items_per_sec"))
            tail = self.losses[-10:]
            print(
                f"[train_long_context] steps={len(self.losses)} first_loss={self.losses[0]:.3f}"
                f" last_loss={self.losses[-1]:.3f} mean_last_10={sum(tail) / len(tail):.3f}"
                f" tok/s={'n/a' if rate is None else f'{float(rate):.0f}'}"
                f" (seq_len={self.seq_len}, sp_size={trainer.strategy.sp_size}, world_size={trainer.world_size})",
                flush=True,
            )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--accelerator", default="gpu" if gpu else "cpu", help="cpu or gpu")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if gpu else 2,
                   help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (SLURM/torchrun multi-node)")
    p.add_argument("--sp-size", type=int, default=None,
                   help="ranks per sequence; None: gcd(devices, heads). The rest is data parallelism")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--seq-len", type=int, default=16384 if gpu else 2048, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step per data-parallel replica")
    p.add_argument("--max-steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW peak learning rate (warmup, cosine)")
    p.add_argument("--hidden-size", type=int, default=512 if gpu else 128, help="model width (random-init model)")
    p.add_argument("--layers", type=int, default=8 if gpu else 4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8 if gpu else 4, help="attention heads (at least one per Ulysses rank)")
    p.add_argument("--kv-heads", type=int, default=4 if gpu else 2, help="key/value heads (GQA)")
    p.add_argument("--precision", default="bf16-mixed" if gpu else "32-true", help="Lightning precision")
    p.add_argument("--corpus-mb", type=int, default=8, help="how much of the stdlib source to read (MiB)")
    p.add_argument("--model-path", default=None, help="a LOCAL Hugging Face checkpoint dir (vocab >= 258)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    args = p.parse_args()
    if args.sp_size is None:
        heads = args.heads
        if args.model_path:
            from transformers import AutoConfig

            heads = AutoConfig.from_pretrained(args.model_path).num_attention_heads
        args.sp_size = math.gcd(args.devices, heads)
    return args


def main() -> None:
    args = parse_args()
    seed_everything(args.seed, verbose=False)  # same initial weights on every rank
    module = CausalLM(args)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage),
        max_steps=args.max_steps,
        precision=args.precision,
        logger=CSVLogger(OUT_DIR, name="train_long_context"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[
            SequenceParallelThroughputMonitor(window_size=THROUGHPUT_WINDOW),  # tokens/s, logged to the CSV metrics
            TrainingSummary(args.seq_len),
            StepProgressBar(),  # the bar shows steps out of max_steps
        ],
    )
    trainer.fit(module)


if __name__ == "__main__":
    main()

"""Pretrain a LitGPT model with Ulysses sequence parallelism under Lightning Fabric: LitGPT's own
``litgpt/pretrain.py`` (``setup`` builds Fabric, ``main`` builds the model, the optimizer and the loaders, ``fit``
counts ``iter_num`` and validates, ``fabric.save`` writes the ``state``), small and self-contained.

    python examples/litgpt_pretrain.py                                   # CPU: 2 processes, sp_size=2, about a minute
    python examples/litgpt_pretrain.py --optimizer sgd --lr 0.5 --max-norm 0   # plain SGD, no gradient clipping
    torchrun --nproc_per_node=2 examples/litgpt_pretrain.py              # the same, started by torchrun
    python examples/litgpt_pretrain.py --devices 1 --sp-size 1           # the single-device baseline (CPU)
    python examples/litgpt_pretrain.py --model-name Llama-3.2-1B --devices 8 --sp-size 8 --seq-len 32768  # 8 GPUs
    python examples/litgpt_pretrain.py --model-name Llama-3.2-1B --devices 8 --strategy deepspeed --seq-len 4096

(The CPU lines are what the tests run; the two CUDA lines are the same script on a GPU node.)

The model is a LitGPT ``GPT`` built from a named config (``--model-name``) without weights; on a machine without a
GPU ``--n-layer``/``--n-head``/``--n-embd`` shrink it to a CPU size (on a GPU they default to the config's own). The
data need no download: the Python standard library's ``.py`` files as bytes (a 256-token vocabulary), packed into
rows of ``--seq-len + 1`` tokens, as LitGPT packs its pretraining corpora; the validation rows come from the other
end of the (sorted) file list. Every rank of a data-parallel replica reads the same rows; each holds
``seq_len / sp_size`` tokens of every row. The per-iteration losses go to ``OUT_DIR/losses.json``, the final
state to ``OUT_DIR/final`` (DeepSpeed's checkpoint directory, with the strategy's completion marker).

What changes from LitGPT's script:

1. **The strategy line.** ``strategy = UlyssesDeepSpeedStrategy(sp_size=..., stage=...)`` where LitGPT has
   ``FSDPStrategy(...)`` (``--strategy deepspeed`` runs Fabric's own ``DeepSpeedStrategy`` for comparison: it runs on
   CUDA only, and each rank then holds whole rows). Gradient clipping is DeepSpeed's
   (``strategy.config["gradient_clipping"]``) instead of ``fabric.clip_gradients``.
2. **Batches are dicts.** ``{"input_ids": row[:-1], "shift_labels": row[1:]}``: LitGPT's input/target split of a
   row, made in the dataset instead of in the loop, because the loader's collate step cuts each batch into this
   rank's shard and the targets must be cut with the inputs (it also adds ``position_ids``, the global positions,
   which the prepared model's RoPE follows). The model is called as in LitGPT: ``model(batch["input_ids"])``.
3. **The loss.** ``fabric.strategy.cross_entropy(logits, batch["shift_labels"])``: the mean over the targets of the
   whole batch, the same number on every rank. LitGPT's ``chunked_cross_entropy`` on a shard would be the mean over
   this rank's shard only (the strategy refuses such a loss in ``fabric.backward``).

Left out for brevity: ``torch.compile``, the throughput monitor, loggers, resuming and gradient accumulation (as
in LitGPT: ``with fabric.no_backward_sync(model, enabled=is_accumulating):`` around the micro-batch and
``fabric.backward(loss / k)``; see docs/fabric.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pprint
import sysconfig
import time
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

import lightning as L
from lightning.fabric.strategies import DeepSpeedStrategy
from litgpt.model import GPT, Config
from litgpt.utils import CycleIterator, chunked_cross_entropy, num_parameters, save_config
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses import checkpoint_status
from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy

OUT_DIR = Path(__file__).resolve().parent / "out" / "litgpt_pretrain"
VOCAB = 256  # byte-level tokens

for _noise in (".*does not have many workers.*", ".*all_gather_into_tensor.*", ".*reduce_scatter_tensor.*"):
    warnings.filterwarnings("ignore", _noise)


# ----------------------------------------------------------------------------------------------- data
def stdlib_token_rows(seq_len: int, count: int, split: str = "train") -> torch.Tensor:
    """``[count, seq_len + 1]`` byte tokens: the standard library's ``.py`` files concatenated and cut into rows.
    ``"train"`` reads the sorted file list from its start, ``"val"`` from its end, so the two never share a file
    while the corpus lasts (tens of MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    needed = count * (seq_len + 1)
    stream = bytearray()
    for path in files if split == "train" else reversed(files):
        stream += path.read_bytes()
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise ValueError(f"the standard library holds {len(stream)} bytes, {needed} are needed")
    return torch.frombuffer(stream[:needed], dtype=torch.uint8).long().view(count, seq_len + 1)


class TokenRows(Dataset):
    """Packed rows as LitGPT splits them: ``input_ids = row[:-1]``, targets ``shift_labels = row[1:]``."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        return {"input_ids": row[:-1], "shift_labels": row[1:]}


def get_dataloaders(args: argparse.Namespace, data_parallel: int) -> tuple[DataLoader, DataLoader]:
    """One pass over ``max_iters`` batches of training rows (in order: no shuffle) and ``eval_iters`` validation
    batches, for ``data_parallel`` replicas."""
    rows_per_iter = args.micro_batch_size * data_parallel
    train = TokenRows(stdlib_token_rows(args.seq_len, args.max_iters * rows_per_iter, "train"))
    val = TokenRows(stdlib_token_rows(args.seq_len, args.eval_iters * rows_per_iter, "val"))
    return (DataLoader(train, batch_size=args.micro_batch_size, shuffle=False),
            DataLoader(val, batch_size=args.micro_batch_size, shuffle=False))


# ----------------------------------------------------------------------------------------------- model
def model_config(args: argparse.Namespace) -> Config:
    """The named LitGPT config with a byte vocabulary, ``block_size = seq_len`` and the sizes given on the command
    line (``None``: the config's own)."""
    base = Config.from_name(args.model_name)
    n_head = args.n_head or base.n_head
    overrides = {"block_size": args.seq_len, "vocab_size": VOCAB, "padded_vocab_size": VOCAB}
    if args.n_layer:
        overrides["n_layer"] = args.n_layer
    if args.n_head or args.n_embd:
        n_embd = args.n_embd or base.n_embd
        # multi-head attention stays multi-head; grouped-query attention keeps groups that divide the heads
        groups = n_head if base.n_query_groups == base.n_head else math.gcd(base.n_query_groups, n_head)
        overrides.update(n_head=n_head, n_embd=n_embd, head_size=n_embd // n_head, n_query_groups=groups)
    if args.n_embd:
        overrides["intermediate_size"] = 4 * args.n_embd
    return Config.from_name(args.model_name, **overrides)


def build_model(config: Config, seed: int) -> GPT:
    """``GPT(config)`` initialised by LitGPT's ``GPT._init_weights`` (normal, std 0.02), the same on every rank."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.apply(model._init_weights)
    return model


def learning_rate(base_lr: float, it: int, warmup_iters: int, max_iters: int, min_lr: float) -> float:
    """LitGPT's schedule: linear warmup, then cosine decay to ``min_lr``."""
    if it < warmup_iters:
        return base_lr * it / warmup_iters
    decay_ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0))) * (base_lr - min_lr)


def make_optimizer(name: str, parameters, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))  # LitGPT's AdamW


def next_token_loss(fabric: L.Fabric, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's targets. Under sequence parallelism this rank holds a shard of each row,
    and ``strategy.cross_entropy`` takes the mean over every rank's shard (LitGPT's ``chunked_cross_entropy`` would
    take it over this shard alone)."""
    if isinstance(fabric.strategy, UlyssesDeepSpeedStrategy):
        return fabric.strategy.cross_entropy(logits, targets)
    return chunked_cross_entropy(logits, targets)


# ----------------------------------------------------------------------------------------------- training
def setup(args: argparse.Namespace) -> None:
    """Fabric with the chosen strategy; ``main`` in every process."""
    if args.strategy == "deepspeed":
        if not torch.cuda.is_available():
            raise SystemExit("Fabric's DeepSpeedStrategy runs on CUDA only. On CPU, the baseline without sequence"
                             " parallelism is `--strategy ulysses --sp-size 1` (`--devices 1` for one device).")
        strategy = DeepSpeedStrategy(stage=args.stage)
    else:
        strategy = UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage)
    strategy.config["gradient_clipping"] = args.max_norm  # DeepSpeed clips (0: no clipping)
    fabric = L.Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=args.devices,
                      num_nodes=args.num_nodes, strategy=strategy, precision=args.precision)
    fabric.launch()  # starts the other processes when run as `python examples/litgpt_pretrain.py`
    fabric.print(pprint.pformat(vars(args)))
    main(fabric, args)


def main(fabric: L.Fabric, args: argparse.Namespace) -> None:
    out_dir = Path(args.out_dir)
    if fabric.global_rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    fabric.seed_everything(args.seed)

    t0 = time.perf_counter()
    config = model_config(args)
    with fabric.init_module():
        model = build_model(config, args.seed)
    fabric.print(f"Time to instantiate model: {time.perf_counter() - t0:.02f} seconds.")
    fabric.print(f"Total parameters: {num_parameters(model):,}")

    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    model, optimizer = fabric.setup(model, optimizer)  # Ulysses: LitGPT's attention and RoPE made sequence-parallel

    sp_size = args.sp_size if args.strategy == "ulysses" else 1
    train_loader, val_loader = get_dataloaders(args, data_parallel=fabric.world_size // sp_size)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)  # each rank: its shard of each row

    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    train_time = time.perf_counter()
    losses = fit(fabric, state, train_loader, val_loader, args)

    fabric.print(f"Saving checkpoint to {str(out_dir / 'final')!r}")
    if fabric.global_rank == 0:  # before the save, so that the checkpoint's file list (and digests) include it
        (out_dir / "final").mkdir(exist_ok=True)
        save_config(config, out_dir / "final")
    fabric.save(out_dir / "final", state)
    if fabric.global_rank == 0:
        (out_dir / "losses.json").write_text(json.dumps(losses, indent=1))
        if args.strategy == "ulysses":
            complete, why = checkpoint_status(out_dir / "final")
            fabric.print(f"Checkpoint complete: {complete} {why}".rstrip())

    tokens = state["iter_num"] * args.micro_batch_size * args.seq_len * fabric.world_size // sp_size
    fabric.print(f"Trained {state['iter_num']} iterations on {tokens:,} tokens in"
                 f" {time.perf_counter() - train_time:.1f} s (sp_size={sp_size}, world_size={fabric.world_size},"
                 f" ZeRO {args.stage})")


def fit(fabric: L.Fabric, state: dict, train_loader: DataLoader, val_loader: DataLoader,
        args: argparse.Namespace) -> dict:
    """LitGPT's loop: ``max_iters`` iterations, a learning rate per iteration, validation every ``eval_interval``
    iterations and at the end. Returns the losses as logged."""
    model, optimizer = state["model"], state["optimizer"]
    fabric.print("Verifying settings ...")
    validate(fabric, model, val_loader, max_iters=2)  # sanity check, as LitGPT's
    losses: dict = {"train_loss": [], "val_loss": {}}
    val_loss = "n/a"
    train_iterator = CycleIterator(train_loader)
    while state["iter_num"] < args.max_iters:
        batch = next(train_iterator)
        lr = learning_rate(args.lr, state["iter_num"], args.warmup_iters, args.max_iters, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        state["iter_num"] += 1
        iter_t0 = time.perf_counter()

        logits = model(batch["input_ids"])
        loss = next_token_loss(fabric, logits, batch["shift_labels"])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step_count"] += 1

        losses["train_loss"].append(loss.item())
        fabric.print(f"Epoch {train_iterator.epoch + 1} | iter {state['iter_num']} step {state['step_count']} |"
                     f" loss train: {loss.item():.4f}, val: {val_loss} |"
                     f" iter time: {(time.perf_counter() - iter_t0) * 1000:.2f} ms | lr {lr:.2e}")

        if state["iter_num"] % args.eval_interval == 0 or state["iter_num"] == args.max_iters:
            t0 = time.perf_counter()
            value = validate(fabric, model, val_loader, max_iters=args.eval_iters).item()
            losses["val_loss"][state["iter_num"]] = value
            val_loss = f"{value:.3f}"
            fabric.print(f"iter {state['iter_num']}: val loss {value:.4f}, val ppl {math.exp(value):.2f},"
                         f" val time: {(time.perf_counter() - t0) * 1000:.2f} ms")
    return losses


@torch.no_grad()
def validate(fabric: L.Fabric, model, val_loader: DataLoader, max_iters: int) -> torch.Tensor:
    """Mean loss of the first ``max_iters`` validation batches, averaged over the data-parallel replicas."""
    model.eval()
    losses = []
    for batch in itertools.islice(val_loader, max_iters):  # stops without fetching one batch more
        logits = model(batch["input_ids"])
        losses.append(next_token_loss(fabric, logits, batch["shift_labels"]))
    model.train()
    return fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")


# ----------------------------------------------------------------------------------------------- command line
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model-name", default="pythia-14m", help="a LitGPT named config (litgpt.config.name_to_config)")
    p.add_argument("--n-layer", type=int, default=None if gpu else 2, help="layers (None: the config's)")
    p.add_argument("--n-head", type=int, default=None if gpu else 4, help="attention heads (None: the config's)")
    p.add_argument("--n-embd", type=int, default=None if gpu else 64, help="embedding width (None: the config's)")
    p.add_argument("--strategy", choices=["ulysses", "deepspeed"], default="ulysses",
                   help="UlyssesDeepSpeedStrategy, or Fabric's own DeepSpeedStrategy (CUDA only)")
    p.add_argument("--sp-size", type=int, default=2, help="ranks per sequence (ulysses)")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if gpu else 2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--precision", default="bf16-mixed" if gpu else "32-true", help="Fabric precision")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (the model's block_size)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="rows per iteration per data-parallel replica")
    p.add_argument("--max-iters", type=int, default=200, help="training iterations")
    p.add_argument("--eval-interval", type=int, default=50, help="validate every N iterations (and at the end)")
    p.add_argument("--eval-iters", type=int, default=2, help="validation batches")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="AdamW as LitGPT, or plain SGD")
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=4e-4, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup-iters", type=int, default=10, help="iterations of linear warmup")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)")
    p.add_argument("--out-dir", default=str(OUT_DIR), help="where losses.json and the final checkpoint go")
    p.add_argument("--seed", type=int, default=42, help="seed for the model's initialisation")
    return p.parse_args(argv)


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    setup(parse_args())

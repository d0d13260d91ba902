"""Fine-tune a pretrained Hugging Face causal LM on long documents with Ulysses sequence parallelism (Lightning +
DeepSpeed ZeRO-3): the complete run a user copies and edits.

    python examples/finetune.py                                        # CPU: 2 processes, sp_size=2, about 3 minutes
    python examples/finetune.py --lora                                 # LoRA adapters instead of full fine-tuning
    python examples/finetune.py --model-path /path/to/local/hf/model --seq-len 32768    # a real model (GPU)
    torchrun --nproc_per_node=2 examples/finetune.py

What it does, in the order a fine-tuning job does it:

1. **Base model.** ``--model-path`` is a LOCAL Hugging Face checkpoint (model + tokenizer). Without it the script
   makes a small one under ``examples/out/finetune/base-model`` first (a byte-level BPE tokenizer trained on the
   corpus with ``tokenizers``, a randomly initialised Llama saved with ``save_pretrained``), so the example runs on
   a fresh CPU machine with nothing downloaded. It stands in for a real checkpoint: the fine-tuning code below does
   not know the difference.
2. **Data.** The corpus is the Python standard library's own source (``.py`` files as long documents, nothing
   downloaded), tokenized with the checkpoint's tokenizer and **packed**: documents are concatenated into rows of
   ``--seq-len`` tokens, ``position_ids`` restart at every document, so no token attends across documents (the
   strategy detects the packing; on CPU ``sdpa_per_document=True`` runs attention per document, on CUDA
   flash-attention's varlen kernel does). The last documents are held out for validation.
3. **Model building** in ``configure_model`` (Lightning's place for large models): at ZeRO-3 the weights are
   partitioned as ``from_pretrained`` loads them, never whole on every rank. Gradient checkpointing on; with
   ``--lora`` PEFT LoRA adapters on the attention projections (the base weights frozen).
4. **Training** with ``UlyssesDeepSpeedStrategy``: each sequence split over ``--sp-size`` ranks; validation loss and
   perplexity over all held-out tokens every ``--val-every`` steps, the loss by position in the context
   (``loss_by_position.png``) and passkey retrieval at the first and the final validation (``passkey.png``), all
   computed sequence-parallel; ``ModelCheckpoint`` keeps the best.
5. **After training**: ``trainer.validate(ckpt_path="best")``, then ``export_checkpoint`` turns the best ZeRO
   checkpoint into a plain ``save_pretrained`` directory (LoRA merged into the weights; the adapter alone next to
   it), which plain ``transformers`` loads in one process to print a short greedy continuation.
"""

import argparse
import math
import os
import sysconfig
import time
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported anywhere

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses import (PasskeyRetrieval, PositionalLoss, TokenWeightedLoss, TokenWeightedPerplexity,
                               StepProgressBar, UlyssesDeepSpeedStrategy, export_checkpoint)

OUT_DIR = Path(__file__).resolve().parent / "out" / "finetune"
PROMPT = "def read_config(path):\n    "

for _noise in (".*does not have many workers.*", ".*LeafSpec.*", ".*all_gather_into_tensor.*",
               ".*gradient_checkpointing.*", ".*reduce_scatter_tensor.*", ".*modules? in eval mode.*"):
    warnings.filterwarnings("ignore", _noise)


# ----------------------------------------------------------------------------------------------- base model
def stdlib_documents(max_bytes: int) -> list[str]:
    """The standard library's ``.py`` files (sorted), as text, until ``max_bytes`` are read."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    documents, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            documents.append(text)
            total += len(text)
        if total >= max_bytes:
            break
    return documents


def make_small_pretrained_model(target: Path, seed: int, pretrain_steps: int) -> None:
    """A stand-in for a downloaded checkpoint: BPE tokenizer + small Llama, both ``save_pretrained`` to ``target``.
    Written to a temporary directory and renamed, so a concurrent reader never sees half of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(stdlib_documents(4 * 2**20), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                           pad_token="<pad>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                         pad_token_id=hf_tokenizer.pad_token_id, bos_token_id=hf_tokenizer.bos_token_id,
                         eos_token_id=hf_tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    pretrain_briefly(model, hf_tokenizer, stdlib_documents(2 * 2**20), steps=pretrain_steps)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    model.save_pretrained(tmp)
    hf_tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)


def pretrain_briefly(model, tokenizer, documents: list[str], steps: int, seq_len: int = 512,
                     batch_size: int = 8) -> None:
    """A short plain-PyTorch pre-training of the stand-in (one process, no Lightning), so that the fine-tuning
    below starts from a model that has learned something, as a real checkpoint has."""
    ids = torch.tensor([t for text in documents for t in tokenizer(text, add_special_tokens=False)["input_ids"]])
    rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = rows[torch.randint(len(rows), (batch_size,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"[finetune] pre-training the stand-in: step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)


def base_model_path(args: argparse.Namespace) -> Path:
    if args.model_path:
        return Path(args.model_path)
    target = OUT_DIR / "base-model"
    if not target.exists():
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"[finetune] no --model-path: making a small pretrained stand-in under {target}", flush=True)
            make_small_pretrained_model(target, args.seed, args.pretrain_steps)
        else:  # torchrun starts every rank at once: wait for local rank 0
            deadline = time.monotonic() + 600
            while not target.exists() and time.monotonic() < deadline:
                time.sleep(1)
    return target


# ----------------------------------------------------------------------------------------------- data
class PackedDocuments(Dataset):
    """Documents tokenized (``<s> text </s>``) and packed into rows of ``seq_len`` tokens; ``position_ids`` restart
    at 0 at every document, so the strategy keeps the documents apart. A document longer than ``seq_len`` is cut
    into pieces of at most ``seq_len`` tokens (positions restart per piece); a piece that does not fit at the end of
    a row continues in the next one with its positions still counting."""

    def __init__(self, documents: list[str], tokenizer, seq_len: int) -> None:
        ids, positions = [], []
        for text in documents:
            tokens = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"],
                      tokenizer.eos_token_id]
            for start in range(0, len(tokens), seq_len):  # pieces of at most seq_len tokens
                piece = tokens[start:start + seq_len]
                ids.extend(piece)
                positions.extend(range(len(piece)))
        rows = len(ids) // seq_len
        if rows == 0:
            raise ValueError(f"The corpus has {len(ids)} tokens, fewer than one row of {seq_len}.")
        self.input_ids = torch.tensor(ids[: rows * seq_len]).view(rows, seq_len)
        self.position_ids = torch.tensor(positions[: rows * seq_len]).view(rows, seq_len)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.input_ids[i]
        # Labels as the model sees them; the strategy shifts them and never lets a document predict the next one.
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": self.position_ids[i]}


# ----------------------------------------------------------------------------------------------- the module
class FineTune(LightningModule):
    """A plain fine-tuning LightningModule: nothing in it is specific to sequence parallelism."""

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        super().__init__()
        self.args, self.model_path = args, model_path
        self.model = None
        self.val_loss = TokenWeightedLoss()
        self.val_perplexity = TokenWeightedPerplexity()
        self.loss_by_position = PositionalLoss(max_position=args.seq_len, num_buckets=12)  # log-spaced buckets
        self.datasets = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, attn_implementation=self.args.attn,
                                                     dtype=torch.float32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.args.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        self.model = model

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.val_loss.update(loss, batch["shift_labels"])  # token-weighted over all held-out tokens
        self.val_perplexity.update(loss, batch["shift_labels"])
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_ppl", self.val_perplexity)
        strategy = self.trainer.strategy  # per-token losses of this rank's shard, kept from the forward pass above
        self.loss_by_position.update(strategy.token_losses(), batch, strategy.token_correct())

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.loss_by_position.as_dict("val_loss_at"))
        zero = self.trainer.is_global_zero  # every rank calls save (it sums the buckets over all ranks)
        self.loss_by_position.save(OUT_DIR / "loss_by_position.png" if zero else None,
                                   OUT_DIR / "loss_by_position.csv" if zero else None,
                                   title=f"validation loss by position (step {self.trainer.global_step})")
        self.loss_by_position.reset()

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.args.lr, weight_decay=0.0, betas=(0.9, 0.95))
        warmup = max(1, self.args.max_steps // 10)

        def schedule(step: int) -> float:  # linear warmup, cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.args.max_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _data(self) -> tuple[Dataset, Dataset]:
        if self.datasets is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            documents = stdlib_documents(self.args.corpus_mb * 2**20)
            held_out = max(1, len(documents) // 50)
            self.datasets = (PackedDocuments(documents[:-held_out], tokenizer, self.args.seq_len),
                             PackedDocuments(documents[-held_out:], tokenizer, self.args.seq_len))
        return self.datasets

    def train_dataloader(self):
        return DataLoader(self._data()[0], batch_size=self.args.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self._data()[1], batch_size=self.args.batch_size)


# ----------------------------------------------------------------------------------------------- after training
def show_continuation(export_dir: Path, tokenizer_dir: Path, max_new_tokens: int) -> None:
    """Load the export with plain transformers (one process, no DeepSpeed, no SP) and continue a prompt greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    inputs = tokenizer(tokenizer.bos_token + PROMPT, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, no_repeat_ngram_size=3,
                                pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"[finetune] plain transformers, greedy continuation (no repeated 3-grams) of {PROMPT!r}:\n{PROMPT}{text}", flush=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model-path", default=None, help="a LOCAL Hugging Face checkpoint (model + tokenizer)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    p.add_argument("--accelerator", default="gpu" if gpu else "cpu", help="cpu or gpu")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if gpu else 2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes")
    p.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (None: all devices of a node)")
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa; on CUDA also flash_attention_2")
    p.add_argument("--seq-len", type=int, default=32768 if gpu else 2048, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=1, help="rows per step per data-parallel replica")
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--val-every", type=int, default=25, help="validate every N steps")
    p.add_argument("--lr", type=float, default=None, help="AdamW peak LR (default: 1e-3 full, 1e-2 LoRA)")
    p.add_argument("--precision", default="bf16-mixed" if gpu else "32-true", help="Lightning precision")
    p.add_argument("--corpus-mb", type=int, default=4, help="how much standard-library source to read (MiB)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens of the greedy continuation at the end")
    p.add_argument("--pretrain-steps", type=int, default=200,
                   help="without --model-path: steps of the stand-in's short pre-training (made once)")
    p.add_argument("--seed", type=int, default=0, help="seed for data order and LoRA init")
    args = p.parse_args()
    if args.lr is None:
        args.lr = 1e-2 if args.lora else 1e-3
    return args


def main() -> None:
    args = parse_args()
    model_path = base_model_path(args)
    seed_everything(args.seed, verbose=False)
    from transformers import AutoTokenizer

    # Passkey retrieval at the first validation and at the final one (the best checkpoint): lengths up to --seq-len.
    lengths = [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if n <= args.seq_len]
    passkey = PasskeyRetrieval(AutoTokenizer.from_pretrained(model_path), lengths=lengths,
                               depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=2, output_dir=str(OUT_DIR),
                               every_n_validations=args.max_steps // args.val_every)
    checkpoints = ModelCheckpoint(dirpath=OUT_DIR / ("checkpoints-lora" if args.lora else "checkpoints"),
                                  monitor="val_loss", save_top_k=1, filename="{step}-{val_loss:.3f}")
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=args.stage, sdpa_per_document=True),
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        precision=args.precision,
        logger=CSVLogger(OUT_DIR, name="logs"),
        log_every_n_steps=5,
        enable_model_summary=False,
        callbacks=[checkpoints, passkey, StepProgressBar()],  # the bar shows steps out of max_steps
    )
    module = FineTune(args, model_path)
    trainer.fit(module)
    best = checkpoints.best_model_path
    metrics = trainer.validate(module, ckpt_path="best", verbose=False)[0]
    if trainer.is_global_zero:
        print(f"[finetune] best checkpoint {best}: val_loss={metrics['val_loss']:.3f}"
              f" val_ppl={metrics['val_ppl']:.1f} (sp_size={trainer.strategy.sp_size},"
              f" world_size={trainer.world_size}, ZeRO {args.stage}{', LoRA' if args.lora else ''})", flush=True)
        curve = ", ".join(f"{k.split('/')[-1]}: {float(v):.2f}" for k, v in metrics.items()
                          if k.startswith("val_loss_at/"))
        print(f"[finetune] validation loss by position {{{curve}}} -> {OUT_DIR / 'loss_by_position.png'}", flush=True)
        grid = ", ".join(f"{r['length']}@{r['depth']:.2f}: {r['accuracy']:.1f}" for r in passkey.results)
        print(f"[finetune] passkey retrieval accuracy (length@depth) {{{grid}}} -> {OUT_DIR / 'passkey.png'}",
              flush=True)
        export_dir = OUT_DIR / ("export-lora" if args.lora else "export")
        exported = export_checkpoint(best, export_dir)
        print(f"[finetune] exported to {exported['hf']['model']} (plain save_pretrained directory)", flush=True)
        show_continuation(exported["hf"]["model"], model_path, args.new_tokens)


if __name__ == "__main__":
    main()

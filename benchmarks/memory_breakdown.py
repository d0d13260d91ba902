"""Live tensor bytes per rank of a training step, by kind and by layer, against the sequence length at sp 1, 2, 4.

    python benchmarks/memory_breakdown.py                                   # S = 8K, 16K; sp 1, 2, 4; vocab 512, 32000
    python benchmarks/memory_breakdown.py --lengths 4096 --sp 1 2 --vocab 512 --steps 2

A Llama-architecture model (hidden 256, 4 layers, 8 heads, sdpa, fp32) trained with SGD at ZeRO 2, batch 1, each
configuration in fresh ``torchrun`` processes, with :class:`lightning_ulysses.TensorMemoryMonitor` (public API): the
peak of the live tensor bytes made during a step (what CUDA's ``max_memory_allocated`` grows by from the step's
start, on any device), and what is alive at that peak, by kind (saved for backward, exchange buffers, logits and
loss, masks, positions, gradients and optimizer, temporaries) and by layer. The table reports the last step (the
first also holds DeepSpeed's gradient buckets, allocated once: 2 × ``reduce_bucket_size`` elements) and, beside it,
the growth of the process's peak RSS (CPU, glibc's heap with ``MALLOC_MMAP_THRESHOLD_=131072``: see
``benchmarks/sweep.py``), and the losses, which must not depend on sp. Writes ``benchmarks/out/memory_breakdown.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> dict:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ulysses import TensorMemoryMonitor, UlyssesDeepSpeedStrategy

    losses: list[float] = []
    rss = {}

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                max_position_embeddings=args.seq_len, attn_implementation="sdpa", pad_token_id=0))

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Rss(Callback):
        def on_train_start(self, trainer, pl_module):
            rss["base"] = _rss_bytes()

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(1, args.vocab, (args.steps, args.seq_len), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    monitor = TensorMemoryMonitor()
    trainer = Trainer(accelerator="cpu", devices=args.sp, max_steps=args.steps,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp, stage=2, reduce_bucket_size=args.bucket,
                                                        allgather_bucket_size=args.bucket), precision="32-true",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[monitor, Rss()])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    last = monitor.steps[-1]
    return {"peak": last.peak_bytes, "first_peak": monitor.steps[0].peak_bytes, "by_kind": last.by_kind,
            "by_layer": last.by_layer, "by_module": last.by_module, "losses": losses,
            "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss["base"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(args, sp: int, seq_len: int, vocab: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_port",
               str(_free_port()), __file__, "--worker", "--sp", str(sp), "--lengths", str(seq_len), "--vocab",
               str(vocab), "--result-dir", tmp, "--steps", str(args.steps), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--heads", str(args.heads),
               "--bucket", str(args.bucket)]
        env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ, "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // sp))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != sp:
            raise RuntimeError(f"sp={sp} S={seq_len} vocab={vocab} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in files]
    top = max(ranks, key=lambda r: r["peak"])
    return {"sp": sp, "seq_len": seq_len, "vocab": vocab, **top,
            "rss_growth": max(r["rss_growth"] for r in ranks)}


def table(rows: list[dict]) -> str:
    from lightning_ulysses.profiling.tensor_memory import KINDS

    lines = ["| vocab | S | sp | peak MiB/rank | ratio to sp=1 | RSS growth MiB (ratio) | "
             + " | ".join(KINDS) + " | loss (step 1) |",
             "|" + "---|" * (7 + len(KINDS))]
    base = {(r["vocab"], r["seq_len"]): r for r in rows if r["sp"] == 1}
    for r in rows:
        ref = base.get((r["vocab"], r["seq_len"]))
        ratio = f"{r['peak'] / ref['peak']:.3f}" if ref else "-"
        rss = f"{r['rss_growth'] / MIB:.0f} ({r['rss_growth'] / ref['rss_growth']:.2f})" if ref else "-"
        kinds = " | ".join(f"{r['by_kind'].get(k, 0) / MIB:.1f}" for k in KINDS)
        lines.append(f"| {r['vocab']} | {r['seq_len']} | {r['sp']} | {r['peak'] / MIB:.1f} | {ratio} | {rss} | "
                     f"{kinds} | {r['losses'][0]:.6f} |")
    return "\n".join(lines)


def layer_table(rows: list[dict]) -> str:
    """Bytes per rank of each layer at the peak, per token of the shard (KiB): the same at every sp when no rank
    keeps more than its share."""
    lines = ["| vocab | S | sp | " + " | ".join(sorted({k for r in rows for k in r["by_layer"]})) + " |"]
    names = sorted({k for r in rows for k in r["by_layer"]})
    lines.append("|" + "---|" * (3 + len(names)))
    for r in rows:
        tokens = r["seq_len"] // r["sp"]
        lines.append(f"| {r['vocab']} | {r['seq_len']} | {r['sp']} | "
                     + " | ".join(f"{r['by_layer'].get(n, 0) / 1024 / tokens:.2f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 32000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=5_000_000,
                        help="ZeRO reduce/allgather bucket size in elements. DeepSpeed allocates 2 reduce buckets of"
                             " this size in every step's backward, whatever the model's size (Lightning's default 2e8:"
                             " 2 x 763 MiB per rank, the same at any S and sp); the default here holds this model's"
                             " 4.5M parameters in one bucket, as 2e8 does, without hiding the rest")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.sp, args.seq_len, args.vocab = args.sp[0], args.lengths[0], args.vocab[0]
        result = worker(args)
        Path(args.result_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
        return
    rows, start = [], time.time()
    for vocab in args.vocab:
        for seq_len in args.lengths:
            for sp in args.sp:
                rows.append(run_one(args, sp, seq_len, vocab))
                r = rows[-1]
                print(f"  vocab={vocab} S={seq_len} sp={sp}: peak {r['peak'] / MIB:.1f} MiB/rank, RSS growth "
                      f"{r['rss_growth'] / MIB:.0f} MiB ({time.time() - start:.0f} s)", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "memory_breakdown.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print()
    print("Bytes per rank per token of the shard at the peak (KiB), by layer:")
    print(layer_table(rows))


if __name__ == "__main__":
    main()

"""What resuming on another layout costs: load time and peak memory per rank, against a same-layout resume.

    python benchmarks/resume_cost.py            # CPU: a 58M-parameter Llama, ~0.7 GB checkpoint, about 4 minutes

1. One fit of 2 steps on 2 processes (sp=2, ZeRO 2, SGD with momentum) writes a checkpoint.
2. Resumes (one step more each, one ``torchrun`` launch per resume): the same layout (2 processes, ZeRO 2), sp=4 on
   4 processes at ZeRO 2 (the optimizer state re-partitioned), sp=4 on 4 processes at ZeRO 3 (re-partitioned from
   ZeRO 2's layout into ZeRO 3's).

For each resume: the seconds ``strategy.load_checkpoint`` took on rank 0 and the growth of rank 0's resident memory
during it (anonymous memory: memory-mapped shard pages are page cache; peak sampled every 5 ms, over the process's
memory just before the load), also per GB of checkpoint.
Writes ``benchmarks/out/resume_cost.json`` and prints a table. Uses the public API only (the load is timed by
wrapping the strategy instance's ``load_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def _rss_bytes() -> int:
    """Anonymous resident memory (file pages of memory-mapped checkpoint shards are page cache, not counted)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def worker(args) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    seed_everything(0, verbose=False)

    class LM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                 attn_implementation="sdpa", pad_token_id=0)
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            rows = [{"input_ids": (ids := torch.randint(1, args.vocab, (args.seq_len,), generator=g)),
                     "labels": ids.clone()} for _ in range(8)]
            return DataLoader(rows, batch_size=1)

    strategy = UlyssesDeepSpeedStrategy(sp_size=args.procs, stage=args.stage)
    trainer = Trainer(accelerator="cpu", devices=args.procs, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    measured: dict = {}
    original = strategy.load_checkpoint

    def timed_load(*a, **k):
        base, peak, stop = _rss_bytes(), [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_bytes())
                time.sleep(0.005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        started = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            measured["seconds"] = time.perf_counter() - started
            stop.set()
            thread.join()
            measured["peak_growth_mib"] = max(peak[0], _rss_bytes()) - base
            measured["peak_growth_mib"] /= 2**20

    strategy.load_checkpoint = timed_load
    module = LM()
    trainer.fit(module, ckpt_path=args.resume or None)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.global_rank == 0 and args.result:
        Path(args.result).write_text(json.dumps(measured))


def _launch(args, procs: int, stage: int, steps: int, resume: str = "", save: str = "", result: str = "") -> None:
    import torch

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", __file__, "--worker",
           "--procs", str(procs), "--stage", str(stage), "--steps", str(steps), "--resume", resume, "--save", save,
           "--result", result, "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
           str(args.vocab), "--seq-len", str(args.seq_len)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--procs", "--stage", "--steps"):
        p.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--resume", "--save", "--result"):
        p.add_argument(name, default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(Path(tmp) / "saved.ckpt")
        _launch(args, 2, 2, 2, save=checkpoint)
        size_gb = sum(f.stat().st_size for f in Path(checkpoint).rglob("*") if f.is_file()) / 1e9
        for label, procs, stage in (("same layout: 2 ranks, ZeRO 2", 2, 2), ("sp=4 on 4 ranks, ZeRO 2", 4, 2),
                                    ("sp=4 on 4 ranks, ZeRO 3", 4, 3)):
            result = Path(tmp) / f"{procs}-{stage}.json"
            _launch(args, procs, stage, 3, resume=checkpoint, result=str(result))
            m = json.loads(result.read_text())
            rows.append({"resume": label, "seconds": round(m["seconds"], 2),
                         "peak_growth_mib": round(m["peak_growth_mib"], 1),
                         "seconds_per_gb": round(m["seconds"] / size_gb, 2),
                         "peak_growth_mib_per_gb": round(m["peak_growth_mib"] / size_gb, 1)})
    report = {"checkpoint_gb": round(size_gb, 3), "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
              "rows": rows}
    (OUT / "resume_cost.json").write_text(json.dumps(report, indent=1))
    print(f"checkpoint: {size_gb:.2f} GB (saved by 2 ranks, sp=2, ZeRO 2)")
    print(f"{'resume':32s} {'load s':>8s} {'s/GB':>6s} {'peak +MiB (rank 0)':>20s} {'MiB/GB':>8s}")
    for r in rows:
        print(f"{r['resume']:32s} {r['seconds']:8.2f} {r['seconds_per_gb']:6.2f} {r['peak_growth_mib']:20.1f}"
              f" {r['peak_growth_mib_per_gb']:8.1f}")


if __name__ == "__main__":
    main()

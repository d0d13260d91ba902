"""What the safety checks cost: the per-step SP-peer agreement check, the once-per-stage model-form check and the
checkpoint digests.

    python benchmarks/integrity_cost.py                 # CPU: 2 processes, sp=2, S=4096, about 3 minutes
    python benchmarks/integrity_cost.py --seq-len 32768 --hidden 1024 --layers 8     # on 2 GPUs

1. **Agreement checks, end to end**: the same fit (tiny Llama, sp=2, ZeRO 2, SGD) with the checks off
   (``check_sp_agreement=False, check_model_form=False``) and on (the batch check before every step and the loss
   check after every backward; the model-form check before the first step), interleaved ``--repeat`` times in the
   same two processes; median step time of each (the first 2 steps of every fit are skipped). The model-form check
   runs once per stage, between the first batch's arrival (``on_train_batch_start``) and the ``training_step``: that
   gap of the first step, on minus off, is its cost, reported next to the median step time.
2. **Their parts**: ``batch_fingerprint`` of a full ``[1, S]`` batch (``input_ids`` + ``labels``; it runs in the
   collate step, i.e. in the DataLoader workers when there are any), the batch check's all-reduce of 6 int64 and the
   loss check's all-reduce of 8 float64 over the SP group (medians of 500). Their sum over the measured step time is
   the checks' share of a step; end-to-end differences below ~2% are under this machine's noise.
3. **Checkpoint digests**: SHA-256 of a 1 GiB file just written (``hashlib.file_digest``) next to ``torch.save`` of
   the same bytes: GB/s and the ratio. Each rank hashes 1/world of a checkpoint's files.

Writes ``benchmarks/out/integrity_cost.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    cuda = torch.cuda.is_available()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len, attn_implementation="sdpa", pad_token_id=0)
    rows = torch.randint(1, args.vocab, (args.steps, args.seq_len), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(config)
            self.entered: list[float] = []

        def training_step(self, batch, batch_idx):
            self.entered.append(time.perf_counter())
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.starts: list[float] = []
            self.t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            self.starts.append(self.t0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    step_times: dict[str, list[float]] = {"off": [], "on": []}
    first_gaps: dict[str, list[float]] = {"off": [], "on": []}  # first step: batch start -> training_step
    for _ in range(args.repeat):
        for setting in ("off", "on"):
            os.environ["WORLD_SIZE"] = str(args.procs)  # Lightning's teardown removes it after each fit
            timer = StepTimer()
            strategy = UlyssesDeepSpeedStrategy(sp_size=args.procs, stage=2, check_sp_agreement=setting == "on",
                                                check_model_form=setting == "on")
            trainer = Trainer(accelerator="cuda" if cuda else "cpu", devices=args.procs, strategy=strategy,
                              max_steps=args.steps, precision="bf16-mixed" if cuda else "32-true", logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              callbacks=[timer])
            module = Module()
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
            step_times[setting].extend(timer.times[2:])
            first_gaps[setting].append(module.entered[0] - timer.starts[0])

    # The checks' collectives alone, MAX over the SP group (here: the whole world): the batch check's 6 int64 and
    # the loss check's 8 float64.
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def median_all_reduce(values: torch.Tensor) -> float:
        for _ in range(20):
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        samples = []
        for _ in range(500):
            start = time.perf_counter()
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            if cuda:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    batch_check = median_all_reduce(torch.zeros(6, dtype=torch.int64, device=device))
    loss_check = median_all_reduce(torch.zeros(8, dtype=torch.float64, device=device))
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"step_times": step_times, "first_gaps": first_gaps,
                                                 "all_reduce_s": batch_check,
                                                 "loss_all_reduce_s": loss_check}))


def fingerprint_cost(seq_len: int) -> float:
    import torch

    from lightning_ulysses import batch_fingerprint

    ids = torch.randint(0, 32000, (1, seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch_fingerprint(batch)
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        batch_fingerprint(batch)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def digest_cost(size_bytes: int) -> dict[str, float]:
    import torch

    from lightning_ulysses.checkpoint.integrity import file_digest

    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        path = Path(tmp) / "shard.pt"
        tensor = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
        start = time.perf_counter()
        torch.save(tensor, path)
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        file_digest(path)
        hash_s = time.perf_counter() - start
    gb = size_bytes / 1e9
    return {"save_GBps": gb / save_s, "sha256_GBps": gb / hash_s, "sha256_seconds_per_GB": hash_s / gb,
            "hash_over_save": hash_s / save_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2, help="processes = sp_size")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="steps per fit (the first 2 are not timed)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved off/on fits")
    p.add_argument("--digest-mib", type=int, default=1024, help="size of the file hashed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.procs}", __file__, "--worker",
               "--result", str(result), "--procs", str(args.procs), "--seq-len", str(args.seq_len),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
               "--steps", str(args.steps), "--repeat", str(args.repeat)]
        env = {**os.environ}
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        measured = json.loads(result.read_text())
    off = statistics.median(measured["step_times"]["off"])
    on = statistics.median(measured["step_times"]["on"])
    fingerprint_s = fingerprint_cost(args.seq_len)
    parts_share = (fingerprint_s + measured["all_reduce_s"] + measured["loss_all_reduce_s"]) / off
    digests = digest_cost(args.digest_mib * 2**20)
    form_check_s = statistics.median(measured["first_gaps"]["on"]) - statistics.median(measured["first_gaps"]["off"])
    summary = {
        "seq_len": args.seq_len, "procs": args.procs, "hidden": args.hidden, "layers": args.layers,
        "step_s_check_off": off, "step_s_check_on": on, "end_to_end_overhead": on / off - 1,
        "fingerprint_ms": fingerprint_s * 1e3, "fingerprint_ns_per_token": fingerprint_s / args.seq_len * 1e9,
        "all_reduce_ms": measured["all_reduce_s"] * 1e3, "loss_all_reduce_ms": measured["loss_all_reduce_s"] * 1e3,
        "check_share_of_step": parts_share, "model_form_check_ms": form_check_s * 1e3,
        "model_form_check_share_of_step": form_check_s / off, **digests,
    }
    (OUT / "integrity_cost.json").write_text(json.dumps(summary, indent=1))
    print(f"S={args.seq_len}, sp={args.procs}: median step {off * 1e3:.1f} ms with the check off,"
          f" {on * 1e3:.1f} ms on ({100 * (on / off - 1):+.2f}% end to end)")
    print(f"  fingerprint of the full batch {fingerprint_s * 1e3:.3f} ms ({summary['fingerprint_ns_per_token']:.1f}"
          f" ns/token) + batch check all-reduce of 6 int64 {measured['all_reduce_s'] * 1e3:.3f} ms"
          f" + loss check all-reduce of 8 float64 {measured['loss_all_reduce_s'] * 1e3:.3f} ms"
          f" = {100 * parts_share:.3f}% of a step")
    print(f"  model-form check (once per stage, before the first step): {form_check_s * 1e3:.1f} ms ="
          f" {100 * form_check_s / off:.2f}% of one step")
    print(f"  checkpoint digests: SHA-256 {digests['sha256_GBps']:.2f} GB/s ({digests['sha256_seconds_per_GB']:.2f}"
          f" s/GB, per rank on its share); torch.save {digests['save_GBps']:.2f} GB/s; hash/save"
          f" {digests['hash_over_save']:.2f}")


if __name__ == "__main__":
    main()

"""What ``offload_attention`` buys one attention layer: live tensor bytes per rank of its forward and backward pass
against the sequence length, with and without the switch, and the step-time cost (docs/ulysses-offload.md).

    python benchmarks/offload_attention_memory.py                 # sp 2 and 4, S = 8K..32K, 8 chunks (~2 minutes)
    python benchmarks/offload_attention_memory.py --sp 2 --lengths 8192 16384 --chunks 4

Each rank holds its shard of q, k and v (``[1, H, S/sp, D]``, 16 query heads and 4 KV heads of 64, float32) and runs
one attention layer's forward and backward under :class:`lightning_ulysses.TensorMemoryTracker`: the strategy's
Ulysses exchange with a flash kernel (PyTorch SDPA, the exchange of the whole sequence) against
``offload_attention``'s exchange per chunk (:mod:`lightning_ulysses.parallel.offload_attention`). On a CPU there is no
host to offload to: here the chunk store moves each chunk's bytes out of torch (a NumPy copy, as a GPU's copy to
pinned host memory leaves the device) so that the count is what a GPU would hold. Peaks are the layer's own (the
inputs and their gradients, which every layer has, excluded): the largest over the ranks. Times are the forward and
backward wall time on this CPU, both paths side by side in one run. Writes ``benchmarks/out/offload_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
MIB = 2**20
HQ, HKV, D = 16, 4, 64


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from lightning_ulysses import TensorMemoryTracker, ulysses_attention
    from lightning_ulysses.parallel.offload_attention import chunked_ulysses_attention

    import host_emulation

    host_emulation.attention_chunks_on_a_host()
    dist.init_process_group("gloo")
    sp, rank = dist.get_world_size(), dist.get_rank()
    results = []

    class Module:
        training = True

    for S in args.lengths:
        s = S // sp
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, h, s, D, generator=g, requires_grad=True) for h in (HQ, HKV, HKV))
        grad = torch.randn(1, HQ, s, D, generator=g)
        row = {"seq_len": S, "sp": sp}
        for name in ("plain", "offload"):
            def step():
                if name == "plain":
                    out = ulysses_attention(q, k, v, dist.group.WORLD, is_causal=True)  # [1, HQ, s, D]
                else:
                    out = chunked_ulysses_attention(Module(), q, k, v, dist.group.WORLD, S // args.chunks, None,
                                                    {"scaling": D ** -0.5}).transpose(1, 2)
                return torch.autograd.grad(out, (q, k, v), grad)

            step()  # warm-up
            dist.barrier()
            start = time.perf_counter()
            with TensorMemoryTracker() as tracker:
                grads = step()
                inputs_grads = sum(t.numel() * t.element_size() for t in grads)
                del grads
            row[f"{name}_seconds"] = time.perf_counter() - start
            row[f"{name}_peak"] = tracker.result().peak_bytes - inputs_grads  # the layer's own, not its results
        results.append(row)
    dist.destroy_process_group()
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args, sp: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_port",
               str(_free_port()), __file__, "--worker", "--result-dir", tmp, "--chunks", str(args.chunks),
               "--lengths", *map(str, args.lengths)]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // sp))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != sp:
            raise RuntimeError(f"sp={sp} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in files]
    rows = []
    for index, row in enumerate(ranks[0]):
        merged = dict(row)
        for key in ("plain_peak", "offload_peak", "plain_seconds", "offload_seconds"):
            merged[key] = max(r[index][key] for r in ranks)
        rows.append(merged)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--chunks", type=int, default=8, help="chunks of the whole sequence")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = [row for sp in args.sp for row in run(args, sp)]
    OUT.mkdir(exist_ok=True)
    (OUT / "offload_attention.json").write_text(json.dumps(rows, indent=1))
    print(f"One attention layer (16 query heads, 4 KV heads of 64, float32), {args.chunks} chunks, forward + backward:")
    print("| sp | S | plain peak MiB/rank | offload peak MiB/rank | ratio | plain s | offload s | time ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sp']} | {r['seq_len']} | {r['plain_peak'] / MIB:.1f} | {r['offload_peak'] / MIB:.1f} |"
              f" {r['offload_peak'] / r['plain_peak']:.2f} | {r['plain_seconds']:.2f} | {r['offload_seconds']:.2f} |"
              f" {r['offload_seconds'] / r['plain_seconds']:.2f} |")


if __name__ == "__main__":
    main()

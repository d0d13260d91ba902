"""Per-rank peak training memory and tokens/sec over a sweep of sequence lengths, for sp_size 1 and 2 with the ALST
memory switches on and off, plus a hand-written DeepSpeed Ulysses loop without Lightning; the longest trainable
sequence under a per-rank memory budget. Writes ``benchmarks/out/sweep.csv``, ``sweep.png`` and prints a table.

    python benchmarks/sweep.py                       # CPU defaults: S = 2K, 4K, 8K; sp=1 on to 32K while it fits
    python benchmarks/sweep.py --lengths 8192 16384 32768 --hidden 2048 --layers 16 --sp 1 2 4 8   # on GPUs
    python benchmarks/sweep.py --arch qwen3_5 --configs plain --lengths 2048 4096 --search-sp 0   # a hybrid model
    python benchmarks/sweep.py --arch qwen3_5 --configs plain --lengths 4096 --sp 1 2 4 --search-sp 0 --max-length 0

Each configuration runs in fresh processes (``torchrun``), so a peak is never inherited from the previous one.
Memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the process's peak RSS from just before the
first step to the end (``ru_maxrss``; includes gradients and allocator slack, excludes what existed before
training). On CPU the workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set): by default glibc raises its
mmap threshold to the size of each freed block (up to 32 MiB), after which freed activation buffers stay in the
heap and the peak RSS measures fragmentation, not tensors (single process, 8K tokens, ALST switches: 1155 MiB with
the dynamic threshold, 868 MiB with the fixed one; plain: 5158 vs 4877 MiB). CUDA's caching allocator is unaffected.

After the grid of ``--lengths``, each configuration with an sp in ``--search-sp`` (default: sp=1, to keep the CPU run
under 20 minutes) whose longest length fits the budget is run at twice that length (up to ``--max-length``) while a linear projection from its last two points stays under the budget,
then once at the length where that projection reaches 97% of the budget (``refined_search_length``), so the
"longest trainable sequence" is measured, not extrapolated, and not quantised to powers of two. Configurations ("plain sp=1" is the baseline: on CPU Lightning's stock DeepSpeedStrategy refuses to run,
so it is this strategy with sp_size=1 and every switch off):

* ``plain``: strategy, all memory switches off;  ``alst``: ``tiled_mlp="auto", tiled_loss="auto",
  offload_checkpoints=True`` (tile counts grow with the sequence, as in ALST); ``offload``:
  ``offload_attention=True`` (Ulysses-Offload: attention in chunks, on CUDA the chunks in pinned host memory);
  ``alst-offload``: both;
* ``deepspeed-loop``: DeepSpeed's own ``UlyssesSPAttentionHF`` + ``deepspeed.initialize``, no Lightning (timing
  reference for the strategy's overhead, same model, same settings).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
SWITCHES = {"plain": {}, "alst": {"tiled_mlp": "auto", "tiled_loss": "auto", "offload_checkpoints": True},
            "offload": {"offload_attention": True},  # Ulysses-Offload: attention in chunks, the chunks on the host
            "alst-offload": {"tiled_mlp": "auto", "tiled_loss": "auto", "offload_checkpoints": True,
                             "offload_attention": True}}
CPU_MMAP_THRESHOLD = "131072"  # bytes; see the module docstring


# ----------------------------------------------------------------------------------------------- worker side
def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.arch == "qwen3_5":  # a Qwen3.5-shaped hybrid: 3 gated-delta-net layers to 1 attention layer
        from transformers import AutoConfig, AutoModelForCausalLM

        head_dim = args.hidden // args.heads
        config = AutoConfig.for_model(
            "qwen3_5_text", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            head_dim=head_dim, linear_num_value_heads=args.heads, linear_num_key_heads=args.heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, max_position_embeddings=max(args.seq_len, 2048),
            layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(args.layers)],
            pad_token_id=0, tie_word_embeddings=False, use_cache=False)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=max(args.seq_len, 2048),
                         attn_implementation="sdpa", pad_token_id=0)
    return LlamaForCausalLM(config)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Probe:
    """Peak memory growth and step times of this rank."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times, self.base, self.t0 = cuda, [], 0, 0.0

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss_bytes()
        self.t0 = time.perf_counter()

    def step_end(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times.append(now - self.t0)
        self.t0 = now

    def peak_growth(self) -> int:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base

    def device_costs(self) -> dict:
        """On CUDA, what the planner's ``reserved_bytes`` stands for, read at the end of training: the states
        allocated before the first step (``base``), the allocator's reserve over its peak allocation (rounding and
        cached blocks), and the device memory the process holds outside the allocator (the CUDA context, cuBLAS and
        NCCL's own buffers): ``total - free - memory_reserved`` (one process per GPU)."""
        import torch

        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"base_bytes": self.base, "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(),
                "outside_allocator_bytes": total - free - torch.cuda.memory_reserved()}


def _dataset(args):
    import torch

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(1, args.vocab, (args.steps + 1, args.seq_len), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def worker_lightning(args) -> dict:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    cuda = torch.cuda.is_available()
    probe = _Probe(cuda)

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(args)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(Callback):
        def on_train_start(self, trainer, pl_module):
            probe.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            probe.step_end()

    trainer = Trainer(accelerator="cuda" if cuda else "cpu", devices=args.sp, max_steps=args.steps,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp, stage=2, ring_size=args.ring,
                                                        reduce_bucket_size=args.bucket,
                                                        allgather_bucket_size=args.bucket, **SWITCHES[args.config]),
                      precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(Module(), torch.utils.data.DataLoader(_dataset(args), batch_size=1))
    return {"peak_bytes": probe.peak_growth(), "step_times": probe.times, **probe.device_costs()}


def worker_deepspeed(args) -> dict:
    """A hand-written DeepSpeed Ulysses loop: DeepSpeed's own HF attention registration and engine, no Lightning."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed("nccl" if cuda else "gloo")
    model = _model(args)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, micro_batch_size=1)
    # The ZeRO settings Lightning's DeepSpeedStrategy uses by default, so only the framework differs.
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "allgather_partitions": True,
            "reduce_scatter": True, "allgather_bucket_size": args.bucket, "reduce_bucket_size": args.bucket,
            "sub_group_size": 1_000_000_000_000}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": cuda}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                      config=config, mpu=mpu)
    rank, sp = dist.get_rank(), args.sp
    s = args.seq_len // sp
    probe = _Probe(cuda)
    probe.start()
    for batch in _dataset(args)[: args.steps]:
        ids = batch["input_ids"][None].to(engine.device)
        shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        cut = slice(rank * s, (rank + 1) * s)
        logits = engine(input_ids=ids[:, cut], position_ids=torch.arange(args.seq_len, device=ids.device)[None, cut]).logits
        local = F.cross_entropy(logits.float().flatten(0, 1), shift[0, cut], ignore_index=-100, reduction="sum")
        count = torch.tensor(float((shift != -100).sum()), device=ids.device)
        engine.backward(local / count)
        engine.step()
        probe.step_end()
    return {"peak_bytes": probe.peak_growth(), "step_times": probe.times, **probe.device_costs()}


def worker_main(args) -> None:
    result = worker_deepspeed(args) if args.config == "deepspeed-loop" else worker_lightning(args)
    Path(args.result_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------- driver side
def run_one(args, config: str, sp: int, seq_len: int, ring: int = 1) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_port",
               str(29600 + sp), __file__, "--worker", "--config", config, "--sp", str(sp), "--seq-len", str(seq_len),
               "--ring", str(ring), "--result-dir", tmp, *_model_flags(args)]
        env = {"MALLOC_MMAP_THRESHOLD_": CPU_MMAP_THRESHOLD, **os.environ,
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // sp))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != sp:
            print(f"  {config} sp={sp} S={seq_len}: failed (exit {proc.returncode})\n{proc.stderr[-1500:]}")
            return None
        ranks = [json.loads(f.read_text()) for f in files]
    step = sorted(ranks[0]["step_times"][1:] or ranks[0]["step_times"])  # the first step warms up
    median = step[len(step) // 2]
    label = config if ring == 1 else f"{config}+ring{ring}"
    row = {"config": label, "sp": sp, "seq_len": seq_len, "peak_mib_per_rank": max(r["peak_bytes"] for r in ranks) / 2**20,
           "step_s": median, "tokens_per_s": seq_len / median}
    for key in ("base_bytes", "max_allocated_bytes", "max_reserved_bytes", "outside_allocator_bytes"):
        if key in ranks[0]:  # CUDA: the device's fixed costs beside the step (the largest rank's)
            row[key.replace("_bytes", "_mib")] = max(r[key] for r in ranks) / 2**20
    return row


def _measure(args, rows: list[dict], config: str, sp: int, seq_len: int, start: float, ring: int = 1) -> bool:
    row = run_one(args, config, sp, seq_len, ring)
    if row:
        rows.append(row)
        print(f"  {row['config']:>14} sp={sp} S={seq_len:>6}: {row['peak_mib_per_rank']:8.1f} MiB/rank, "
              f"{row['tokens_per_s']:8.0f} tok/s  ({time.time() - start:.0f} s)", flush=True)
    return row is not None


def next_search_length(rows: list[dict], config: str, sp: int, args) -> int | None:
    """Twice the longest measured length of ``(config, sp)`` if that fitted the budget, the result stays within
    ``--max-length`` and the linear projection from the last two measured points fits too; else ``None``."""
    points = sorted((r["seq_len"], r["peak_mib_per_rank"]) for r in rows if (r["config"], r["sp"]) == (config, sp))
    if len(points) < 2 or points[-1][1] > args.budget_mib:
        return None
    (n1, m1), (n2, m2) = points[-2:]
    target = 2 * n2
    projected = m2 + (m2 - m1) / (n2 - n1) * (target - n2)
    return target if target <= args.max_length and projected <= args.budget_mib else None


def refined_search_length(rows: list[dict], config: str, sp: int, args) -> int | None:
    """After the doubling stopped: the length at which the line through the last two measured points reaches 97% of
    the budget (rounded down to a multiple of 1024), if it lies at least 1024 past the longest length that fitted;
    else ``None``. Measured like every other point, so the longest trainable sequence is not quantised to powers of
    two."""
    points = sorted((r["seq_len"], r["peak_mib_per_rank"]) for r in rows if (r["config"], r["sp"]) == (config, sp))
    fitting = [p for p in points if p[1] <= args.budget_mib]
    if len(fitting) < 2:
        return None
    (n1, m1), (n2, m2) = fitting[-2:]
    if m2 <= m1:
        return None
    target = int((n2 + (0.97 * args.budget_mib - m2) / (m2 - m1) * (n2 - n1)) // 1024 * 1024)
    measured = {n for n, _ in points}
    return target if target >= n2 + 1024 and target <= args.max_length and target not in measured else None


def _model_flags(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--steps", str(args.steps), "--bucket", str(args.bucket), "--arch", args.arch]


def longest_under_budget(rows: list[dict], config: str, sp: int, budget_mib: float) -> int:
    fits = [r["seq_len"] for r in rows if r["config"] == config and r["sp"] == sp and r["peak_mib_per_rank"] <= budget_mib]
    return max(fits, default=0)


def plot(rows: list[dict], path: Path, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["config"], r["sp"]) for r in rows}):
        points = sorted((r["seq_len"], r["peak_mib_per_rank"]) for r in rows if (r["config"], r["sp"]) == key)
        ax.plot(*zip(*points), marker="o", label=f"{key[0]} sp={key[1]}")
    ax.axhline(budget, color="gray", linestyle="--", label=f"budget {budget:.0f} MiB")
    ax.set(xscale="log", yscale="log", xlabel="global sequence length (tokens)", ylabel="peak training memory per rank (MiB)",
           title="Per-rank peak memory vs sequence length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=["plain", "alst", "deepspeed-loop"])
    parser.add_argument("--budget-mib", type=float, default=2400.0, help="per-rank memory budget for the search")
    parser.add_argument("--max-length", type=int, default=32768,
                        help="longest sequence the budget search runs past the --lengths grid (0: no search)")
    parser.add_argument("--search-sp", type=int, nargs="+", default=[1],
                        help="sp sizes whose configurations the budget search extends past the grid")
    parser.add_argument("--arch", choices=["llama", "qwen3_5"], default="llama",
                        help="llama: full attention; qwen3_5: a hybrid of 3 gated-delta-net layers to 1 attention layer"
                             " (its mixers exchange projected channels: tests/test_mixer_exchange.py imports _model)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ring", type=int, nargs="+", default=[1],
                        help="ring_size values to run for every sp they divide (hybrid Ulysses x ring; 1: Ulysses"
                             " only); configurations get the suffix +ringN")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the grid this many times (repeats interleaved); the table keeps the median step"
                             " time (raw runs: sweep_runs.csv)")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--bucket", type=int, default=200_000_000,
                        help="ZeRO reduce/allgather bucket size in elements (Lightning's default 2e8 = 800 MB of fp32"
                             " buffers, allocated in the first step, which the memory growth includes)")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.sp, args.ring = args.sp[0], args.ring[0]
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        worker_main(args)
        return

    OUT.mkdir(exist_ok=True)
    runs, start = [], time.time()
    for _ in range(args.repeat):  # whole grid again: the repeats of one configuration are interleaved with the others
        for seq_len in args.lengths:
            for sp in args.sp:
                for config in args.configs:
                    if config == "deepspeed-loop" and sp == 1:
                        continue  # DeepSpeed's HF Ulysses registration needs sp > 1
                    for ring in args.ring:
                        if sp % ring or (ring > 1 and config == "deepspeed-loop"):
                            continue
                        _measure(args, runs, config, sp, seq_len, start, ring)
    rows = merge_repeats(runs)
    for config, sp in sorted({(r["config"], r["sp"]) for r in rows if r["sp"] in args.search_sp}):
        base, _, ring = config.partition("+ring")
        while (seq_len := next_search_length(rows, config, sp, args)) is not None:
            if not _measure(args, rows, base, sp, seq_len, start, int(ring or 1)):
                break
        if (seq_len := refined_search_length(rows, config, sp, args)) is not None:
            _measure(args, rows, base, sp, seq_len, start, int(ring or 1))
    if args.repeat > 1:
        _write_csv(runs, OUT / "sweep_runs.csv")
    _write_csv(rows, OUT / "sweep.csv")
    plot(rows, OUT / "sweep.png", args.budget_mib)
    print(summary(rows, args))
    if args.repeat > 1:
        print(repeat_ratios(runs))


def repeat_ratios(runs: list[dict]) -> str:
    """Strategy / hand-written loop step time of each repeat (runs in grid order: the i-th of each pair match)."""
    lines = []
    for sp, n in dict.fromkeys((r["sp"], r["seq_len"]) for r in runs):
        plain = [r["step_s"] for r in runs if (r["config"], r["sp"], r["seq_len"]) == ("plain", sp, n)]
        loop = [r["step_s"] for r in runs if (r["config"], r["sp"], r["seq_len"]) == ("deepspeed-loop", sp, n)]
        if plain and loop:
            ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(plain, loop))
            lines.append(f"S={n}: strategy / hand-written loop step time (sp={sp}) per repeat: {ratios}")
    return "\n".join(lines)


def merge_repeats(runs: list[dict]) -> list[dict]:
    """One row per (config, sp, seq_len): the largest peak memory and the median step time of its repeats."""
    merged = []
    for key in dict.fromkeys((r["config"], r["sp"], r["seq_len"]) for r in runs):
        repeats = [r for r in runs if (r["config"], r["sp"], r["seq_len"]) == key]
        step = sorted(r["step_s"] for r in repeats)[len(repeats) // 2]
        merged.append({**repeats[0], "peak_mib_per_rank": max(r["peak_mib_per_rank"] for r in repeats),
                       "step_s": step, "tokens_per_s": key[2] / step, "repeats": len(repeats)})
    return merged


def _write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def summary(rows: list[dict], args) -> str:
    lengths = sorted({r["seq_len"] for r in rows})
    lines = ["", "| config | sp | " + " | ".join(f"S={n} MiB/rank (tok/s)" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for key in sorted({(r["config"], r["sp"]) for r in rows}):
        cells = []
        for n in lengths:
            row = next((r for r in rows if (r["config"], r["sp"], r["seq_len"]) == (*key, n)), None)
            cells.append(f"{row['peak_mib_per_rank']:.0f} ({row['tokens_per_s']:.0f})" if row else "—")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    lines.append("")
    for config, sp in sorted({(r["config"], r["sp"]) for r in rows}):
        longest = longest_under_budget(rows, config, sp, args.budget_mib)
        base_config = config if longest_under_budget(rows, "plain", 1, args.budget_mib) == 0 else "plain"
        base = longest_under_budget(rows, base_config, 1, args.budget_mib)
        ratio = f" ({longest / base:.2f}× {base_config} sp=1)" if base else ""
        lines.append(f"longest measured sequence under {args.budget_mib:.0f} MiB/rank: {config} sp={sp}: {longest}{ratio}")
    by = {(r["config"], r["sp"], r["seq_len"]): r for r in rows}
    for (config, sp, n), r in sorted(by.items()):
        if config == "plain" and sp > 1:
            if (plain1 := by.get(("plain", 1, n))):
                lines.append(f"S={n}: plain sp={sp} / sp=1 peak memory = {r['peak_mib_per_rank'] / plain1['peak_mib_per_rank']:.2f}")
            if (loop := by.get(("deepspeed-loop", sp, n))):
                lines.append(f"S={n}: strategy / hand-written DeepSpeed loop step time (sp={sp}) = {r['step_s'] / loop['step_s']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

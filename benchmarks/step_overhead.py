"""What a training step costs besides the model's compute: a Ulysses step, a ring step and the hand-written DeepSpeed
loop, interleaved in one run, each as a ratio; and the time and the work of the strategy's own per-step code.

    python benchmarks/step_overhead.py                        # CPU: sp=4, S=4096, 4 configs x 3 repeats, ~25 minutes
    python benchmarks/step_overhead.py --repeat 2 --configs ulysses ring4      # a quicker check of one ratio
    python benchmarks/step_overhead.py --sp 8 --seq-len 32768 --hidden 2048 --layers 16                # on GPUs

Configurations (each in fresh ``torchrun`` processes, the sweep's Llama model, SGD, ZeRO 2; the grid runs
``--repeat`` times, so the repeats of every configuration are interleaved with the others'):

* ``ulysses``: ``UlyssesDeepSpeedStrategy(sp_size=sp)`` and a LightningModule (public API only);
* ``ring2`` / ``ring4``: the same with ``ring_size=2`` / ``4`` (hybrid Ulysses x ring; ring4 at sp=4 is ring only);
* ``deepspeed-loop``: DeepSpeed's own ``UlyssesSPAttentionHF`` + ``deepspeed.initialize`` in a hand-written loop, no
  Lightning (as ``benchmarks/sweep.py``'s ``deepspeed-loop``).

Per step and rank the workers record the wall time (between consecutive step ends) and the process's CPU time (all
its threads). The first step is left out (warm-up); the reported step time is the median of the others on rank 0,
and the step's CPU time is the median of the sum over the ranks. With more processes than cores (4 on this 2-core
machine) a busy machine stretches wall times by whatever else runs, while CPU time counts only this run's work, so
both are reported; a ratio is the median over the repeats of the ratio within each repeat.

After the timed steps every strategy run traces two more steps on every rank (neither is timed):

1. :class:`StepTracer` (``sys.setprofile``) attributes each moment of one whole step (from one step's end to the
   next, so the loader's collate step is in it) to the innermost code that is one of: the strategy's own code
   (``lightning_ulysses``); the SP attention (its attention function ``models/hf_attention.py`` and the exchange,
   ring and attention modules: the model's attention, distributed); the loss kernels of the strategy's loss
   (``cross_entropy_sum`` and the like: what transformers' loss computes on one device); the rest (Lightning,
   DeepSpeed, transformers, the model, the LightningModule). Calls into torch, the standard library and C functions
   count for whoever called them. The strategy's share is the **own time** of the step: its Python, its host syncs
   and its collectives (``own_comm``: the SP-peer checks, the loss's sum and count over the group), the latter
   taken on the rank that waited least in them (the others also wait there for slower peers, a wait that without
   the collective would fall in the step's next one). The tracer's callbacks are not counted; what the tracer adds
   to the interpreter per call makes the own time an upper bound.
2. :class:`OpCounter` (a ``TorchDispatchMode``, with the tracer telling whose code runs) counts, per kind of code,
   the collectives (``c10d`` ops; ring passes as ``send``/``recv_``) and the host syncs (``_local_scalar_dense``:
   ``.item()``, ``bool()``/``int()``/``float()`` of a tensor; ``equal``; plus the ``.tolist()`` calls the tracer
   sees), and the tracer counts the entries into the strategy's code (hooks, the collate step, the Lightning
   hooks the strategy overrides) by function.

Writes ``benchmarks/results/step_overhead.json`` (every run, the medians, the ratios, the traced step) and
``step_overhead.txt`` (the table), unless ``--out`` says elsewhere. Record them on every performance change; the
README's ring table and overhead lines come from them.
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
from collections import Counter
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sweep  # noqa: E402  (the sweep's model, data and hand-written loop set-up)

RESULTS = HERE / "results"
CONFIGS = {"ulysses": 1, "ring2": 2, "ring4": 4, "deepspeed-loop": 0}
# lightning_ulysses modules that implement the SP attention (the model's compute, distributed), by file name
ATTENTION_FILES = ("hf_attention.py", "ring.py", "exchange.py", "attention.py", "sinks.py", "image_blocks.py")
# the strategy's functions that compute the model's loss itself (what transformers' loss computes on one device)
LOSS_FUNCTIONS = ("cross_entropy_sum", "token_statistics", "token_cross_entropy", "at_least_fp32")
# code that is the model's compute or the frameworks' own work (its callees count for it)
COMPUTE_PARTS = ("/lightning/", "/deepspeed/", "/transformers/", "/lightning_fabric/")
# torch.distributed's collectives (the Python functions in distributed_c10d.py)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "barrier", "batch_isend_irecv", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce",
               "monitored_barrier")


# ----------------------------------------------------------------------------------------------- tracing
class StepTracer:
    """Attributes wall time to ``own`` (the strategy's code), ``attention`` (its SP attention) and ``other`` code by
    the innermost frame that is one of them (see the module docstring); counts the entries into own code by
    function and the ``.tolist()`` calls made from it. ``label`` is the kind of code running now."""

    def __init__(self, base: str = "other") -> None:
        self.seconds: Counter = Counter()
        self.entries: Counter = Counter()
        self.own_c_calls: Counter = Counter()
        self.own_seconds: Counter = Counter()  # own time (without its collectives) by innermost own function
        self._stack: list[str] = []
        self._names: list[str] = []  # the innermost own function at each depth
        self.where = ""
        self._base = base
        self._kinds: dict[Any, Optional[str]] = {}
        self._last = 0.0
        self.label = base

    def _kind(self, code: Any) -> Optional[str]:
        kind = self._kinds.get(code, "?")
        if kind == "?":
            path = code.co_filename.replace("\\", "/")
            if code.co_name == "__torch_dispatch__":
                kind = None  # the op counter below: whoever called the op
            elif "/lightning_ulysses/" in path:
                name = path.rsplit("/", 1)[-1]
                kind = ("attention" if name in ATTENTION_FILES else
                        "loss" if name == "loss.py" and code.co_name in LOSS_FUNCTIONS else "own")
            elif any(part in path for part in COMPUTE_PARTS) or "/benchmarks/" in path or "/tests/" in path:
                kind = "other"  # the frameworks, the model, the LightningModule
            elif path.endswith("torch/distributed/distributed_c10d.py") and code.co_name in COLLECTIVES:
                kind = "comm"  # a collective (its wait for the peers included): own_comm when own code calls it
            else:
                kind = None  # torch, the standard library: whoever called it
            self._kinds[code] = kind
        return kind

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        now = time.perf_counter()
        self.seconds[self.label] += now - self._last
        if self.label == "own":
            self.own_seconds[self.where] += now - self._last
        if event == "call":
            kind = self._kind(frame.f_code) or self.label
            if kind == "own" and self.label in ("attention", "loss"):
                kind = self.label  # helpers the SP attention or the loss calls (kernels' wrappers, positions)
            elif kind == "comm":
                kind = "own_comm" if self.label in ("own", "own_comm") else self.label
            if kind == "own" and self.label != "own":
                self.entries[frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname")
                             else frame.f_code.co_name] += 1
            self._stack.append(kind)
            self._names.append(frame.f_code.co_qualname if kind == "own" and self._kind(frame.f_code) == "own"
                               else self.where)
        elif event == "c_call":
            if self.label in ("own", "own_comm"):
                self.own_c_calls[getattr(arg, "__name__", str(arg))] += 1
            self._stack.append(self.label)
            self._names.append(self.where)
        elif self._stack:  # return, c_return, c_exception
            self._stack.pop()
            self._names.pop()
        self.label = self._stack[-1] if self._stack else self._base
        self.where = self._names[-1] if self._names else ""
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        self.seconds[self.label] += time.perf_counter() - self._last


def op_counter(tracer: StepTracer):
    """A TorchDispatchMode counting collectives and host syncs per kind of code (``tracer.label``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)  # e.g. "c10d.allreduce_", "aten._local_scalar_dense"
            label = "own" if tracer.label == "own_comm" else tracer.label
            if name.startswith("c10d."):
                self.counts[f"{label}:collective:{name[5:]}"] += 1
            elif name in ("aten._local_scalar_dense", "aten.equal"):
                self.counts[f"{label}:host_sync:{name[5:]}"] += 1
                if label == "own":
                    self.counts[f"where:{tracer.where}:{name[5:]}"] += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


def per_step_counts(tracer: StepTracer, ops: Counter) -> dict:
    """What the strategy's own code did in the counted step: entries by function, collectives and host syncs by op
    (``.tolist()`` from the tracer), and the same for the SP attention."""
    own_syncs = {k.split(":", 2)[2]: n for k, n in ops.items() if k.startswith("own:host_sync:")}
    if tracer.own_c_calls.get("tolist"):
        own_syncs["tolist"] = tracer.own_c_calls["tolist"]
    return {
        "own_entries": dict(sorted(tracer.entries.items())),
        "own_entries_total": sum(tracer.entries.values()),
        "own_collectives": {k.split(":", 2)[2]: n for k, n in sorted(ops.items()) if k.startswith("own:collective:")},
        "own_host_syncs": dict(sorted(own_syncs.items())),
        "own_host_syncs_by_function": {k.split(":", 1)[1]: n for k, n in sorted(ops.items())
                                       if k.startswith("where:")},
        "attention_collectives": {k.split(":", 2)[2]: n for k, n in sorted(ops.items())
                                  if k.startswith("attention:collective:")},
        "attention_host_syncs": {k.split(":", 2)[2]: n for k, n in sorted(ops.items())
                                 if k.startswith("attention:host_sync:")},
    }


# ----------------------------------------------------------------------------------------------- worker side
class _Steps:
    """Wall and CPU time of every step (from one step's end to the next) of this rank, the traced step's time
    split and the counted step's work."""

    def __init__(self, timed: int) -> None:
        self.timed, self.wall, self.cpu = timed, [], []
        self.tracer: Optional[StepTracer] = None
        self.counter: Any = None
        self.traced: dict = {}
        self._t, self._c = 0.0, 0.0

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), time.process_time()

    def end(self, index: int) -> None:
        """Step ``index`` (0-based) ended: record it; the two steps after the timed ones are traced, then counted."""
        if index == self.timed:  # the traced step ended
            self.tracer.stop()
            wall = time.perf_counter() - self._t
            self.traced = {"step_s": wall, "seconds": dict(self.tracer.seconds),
                           "own_ms_by_function": {k: round(1e3 * v, 3) for k, v in
                                                  self.tracer.own_seconds.most_common(12)}}
        elif index == self.timed + 1:  # the counted step ended
            self.counter.__exit__(None, None, None)
            self.tracer.stop()
            self.traced["counts"] = per_step_counts(self.tracer, self.counter.counts)
            self.traced["ops"] = dict(self.counter.counts)
            return
        elif index < self.timed:
            now, cpu = time.perf_counter(), time.process_time()
            self.wall.append(now - self._t)
            self.cpu.append(cpu - self._c)
        if index == self.timed - 1:  # the next step is traced
            self.tracer = StepTracer()
            self._t = time.perf_counter()
            self.tracer.start()
        elif index == self.timed:  # the next one is counted
            self.tracer = StepTracer()
            self.counter = op_counter(self.tracer)
            self.tracer.start()
            self.counter.__enter__()
        else:
            self.start()

    def result(self) -> dict:
        return {"step_s": self.wall, "cpu_s": self.cpu, "traced": self.traced,
                "collective_latency_s": getattr(self, "collective_latency_s", None)}


def collective_latency(device: Any, repeats: int = 200) -> float:
    """Median time of one all-reduce of 8 int64 over the world (the size of the strategy's per-step checks), the
    ranks in step: what one of the strategy's collectives costs in this set-up apart from waiting for slower peers."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(8, dtype=torch.int64, device=device)
    dist.barrier()
    for _ in range(20):
        dist.all_reduce(x)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def worker_strategy(args) -> dict:
    """A Ulysses or ring step through the public API: ``UlyssesDeepSpeedStrategy`` and a LightningModule."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    cuda = torch.cuda.is_available()
    steps = _Steps(args.steps)

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = sweep._model(args)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(Callback):
        def on_train_start(self, trainer, pl_module):
            steps.start()

        def on_train_end(self, trainer, pl_module):
            steps.collective_latency_s = collective_latency(pl_module.device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            steps.end(batch_idx)

    trainer = Trainer(accelerator="cuda" if cuda else "cpu", devices=args.sp, max_steps=args.steps + 2,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp, stage=2, ring_size=CONFIGS[args.config],
                                                        reduce_bucket_size=args.bucket,
                                                        allgather_bucket_size=args.bucket),
                      precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    data = sweep._dataset(argparse.Namespace(**{**vars(args), "steps": args.steps + 2}))
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    return steps.result()


def worker_deepspeed(args) -> dict:
    """The hand-written DeepSpeed Ulysses loop of ``sweep.py`` (DeepSpeed's HF attention registration, its engine,
    the loss by hand), timed the same way."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed("nccl" if cuda else "gloo")
    model = sweep._model(args)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, micro_batch_size=1)
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "allgather_partitions": True,
            "reduce_scatter": True, "allgather_bucket_size": args.bucket, "reduce_bucket_size": args.bucket,
            "sub_group_size": 1_000_000_000_000}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": cuda}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                      config=config, mpu=mpu)
    rank, s = dist.get_rank(), args.seq_len // args.sp
    cut = slice(rank * s, (rank + 1) * s)
    positions = torch.arange(args.seq_len, device=engine.device)[None, cut]
    steps = _Steps(args.steps + 2)  # no strategy code to trace: every step timed, the last two dropped
    steps.start()
    for index, batch in enumerate(sweep._dataset(argparse.Namespace(**vars(args)))[: args.steps]):
        ids = batch["input_ids"][None].to(engine.device)
        shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        logits = engine(input_ids=ids[:, cut], position_ids=positions).logits
        local = F.cross_entropy(logits.float().flatten(0, 1), shift[0, cut], ignore_index=-100, reduction="sum")
        count = torch.tensor(float((shift != -100).sum()), device=ids.device)
        engine.backward(local / count)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        steps.end(index)
    return steps.result()


def worker_main(args) -> None:
    result = worker_deepspeed(args) if args.config == "deepspeed-loop" else worker_strategy(args)
    Path(args.result_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------- driver side
def run_one(args, config: str) -> Optional[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.sp}", "--master_port",
               str(args.port), __file__, "--worker", "--config", config, "--sp", str(args.sp),
               "--seq-len", str(args.seq_len), "--result-dir", tmp, *_model_flags(args)]
        env = {"MALLOC_MMAP_THRESHOLD_": sweep.CPU_MMAP_THRESHOLD, **os.environ,
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.sp))}
        load = os.getloadavg()[0]
        started = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != args.sp:
            print(f"  {config}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            return None
        ranks = [json.loads(f.read_text()) for f in files]
    wall = ranks[0]["step_s"][1:]
    cpu = [sum(r["cpu_s"][i] for r in ranks) for i in range(1, len(ranks[0]["cpu_s"]))]
    row = {"config": config, "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2),
           "run_s": round(time.time() - started, 1), "step_s": statistics.median(wall),
           "cpu_s": statistics.median(cpu), "step_times": ranks[0]["step_s"], "cpu_times_sum": cpu}
    if ranks[0]["traced"]:
        row["traced"] = [r["traced"] for r in ranks]
        seconds = [r["traced"]["seconds"] for r in ranks]
        row["own_s"] = [s.get("own", 0.0) for s in seconds]
        row["own_comm_s"] = [s.get("own_comm", 0.0) for s in seconds]
        row["traced_step_s"] = [r["traced"]["step_s"] for r in ranks]
        row["collective_latency_s"] = ranks[0]["collective_latency_s"]
        row["own_collectives"] = sum(ranks[0]["traced"]["counts"]["own_collectives"].values())
    return row


def _model_flags(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--steps", str(args.steps), "--bucket", str(args.bucket)]


def paired_ratios(runs: list[dict], config: str, base: str, key: str) -> list[float]:
    """``config``'s ``key`` over ``base``'s, within each repeat (the i-th run of each)."""
    a = [r[key] for r in runs if r["config"] == config]
    b = [r[key] for r in runs if r["config"] == base]
    return [x / y for x, y in zip(a, b)]


def summarize(runs: list[dict], args) -> dict:
    configs = list(dict.fromkeys(r["config"] for r in runs))
    out: dict[str, Any] = {"settings": {k: getattr(args, k) for k in ("sp", "seq_len", "hidden", "layers", "heads",
                                                                       "vocab", "steps", "repeat", "bucket")},
                           "configs": {}, "ratios": {}}
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        entry = {"step_s": statistics.median(r["step_s"] for r in mine),
                 "cpu_s": statistics.median(r["cpu_s"] for r in mine), "repeats": len(mine),
                 "load": [r["load_at_start"] for r in mine]}
        if "traced" in mine[0]:
            # The strategy's own work: the rank whose own code (without its collectives) took longest, plus its
            # collectives at what one costs with the ranks in step (measured after the fit). Inside the step the
            # ranks also wait in them for slower peers, a wait that without them would fall in the step's next
            # collective; on the rank that waited least it is reported too (with more processes than cores it
            # includes the wait for a peer to be scheduled).
            work = [max(r["own_s"]) for r in mine]
            comm = [r["own_collectives"] * r["collective_latency_s"] for r in mine]
            own = [w + c for w, c in zip(work, comm)]
            # over the untraced median step (the traced step is a little longer: the tracer's callbacks)
            shares = [o / r["step_s"] for o, r in zip(own, mine)]
            entry.update({"own_ms": 1e3 * statistics.median(own), "own_share_of_step": statistics.median(shares),
                          "own_work_ms": 1e3 * statistics.median(work),
                          "own_collectives_ms": 1e3 * statistics.median(comm),
                          "own_collectives_per_step": mine[0]["own_collectives"],
                          "collective_latency_ms": 1e3 * statistics.median(r["collective_latency_s"] for r in mine),
                          "own_collectives_ms_least_rank": 1e3 * statistics.median(min(r["own_comm_s"]) for r in mine),
                          "own_collectives_ms_most_rank": 1e3 * statistics.median(max(r["own_comm_s"]) for r in mine),
                          "traced_split_s_rank0": mine[-1]["traced"][0]["seconds"],
                          "own_ms_by_function_rank0": mine[-1]["traced"][0].get("own_ms_by_function", {}),
                          "counts_rank0": mine[-1]["traced"][0].get("counts", {})})
        out["configs"][config] = entry
    bases = [b for b in ("ulysses", "deepspeed-loop") if b in configs]
    for config in configs:
        for base in bases:
            if base == config:
                continue
            for key in ("step_s", "cpu_s"):
                ratios = paired_ratios(runs, config, base, key)
                if ratios:
                    out["ratios"][f"{config}/{base} {key}"] = {"median": statistics.median(ratios),
                                                               "per_repeat": ratios}
    return out


def table(summary: dict) -> str:
    s = summary["settings"]
    lines = [f"sp={s['sp']}, S={s['seq_len']}, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, "
             f"{s['repeat']} interleaved repeats of {s['steps']} steps (first left out)", "",
             "| config | step s (rank 0) | CPU s/step (all ranks) | strategy's own code ms/step (work + collectives"
             " x ms each) | share of the step | load at each start |",
             "|---|---|---|---|---|---|"]
    for config, e in summary["configs"].items():
        own = (f"{e['own_ms']:.1f} ({e['own_work_ms']:.1f} + {e['own_collectives_per_step']} x"
               f" {e['collective_latency_ms']:.2f})" if "own_ms" in e else "—")
        share = f"{100 * e['own_share_of_step']:.2f}%" if "own_share_of_step" in e else "—"
        load = "/".join(f"{x:.1f}" for x in e["load"])
        lines.append(f"| {config} | {e['step_s']:.3f} | {e['cpu_s']:.3f} | {own} | {share} | {load} |")
    lines.append("")
    for name, r in summary["ratios"].items():
        per = ", ".join(f"{x:.3f}" for x in r["per_repeat"])
        lines.append(f"{name}: {r['median']:.3f}  (per repeat {per})")
    for config, e in summary["configs"].items():
        counts = e.get("counts_rank0")
        if counts:
            lines.append("")
            lines.append(f"{config}: per step, rank 0: {counts['own_entries_total']} entries into the strategy's code"
                         f" {counts['own_entries']}; its collectives {counts['own_collectives']}; its host syncs"
                         f" {counts['own_host_syncs']}; the SP attention's collectives"
                         f" {counts['attention_collectives']}, host syncs {counts['attention_host_syncs']}")
            split = {k: round(v, 4) for k, v in e["traced_split_s_rank0"].items()}
            lines.append(f"{config}: traced step split (s, rank 0): {split}")
            lines.append(f"{config}: own time by function (ms, rank 0): {e.get('own_ms_by_function_rank0')}")
            lines.append(f"{config}: in the step, its collectives took {e['own_collectives_ms_least_rank']:.1f} ms on"
                         " the rank that waited least for its peers")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (the first is left out)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=200_000_000)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", default=str(RESULTS), help="folder for step_overhead.json / .txt")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.arch = "llama"
    if args.worker:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        worker_main(args)
        return
    runs, start = [], time.time()
    for repeat in range(args.repeat):
        for config in args.configs:
            row = run_one(args, config)
            if row is None:
                continue
            row["repeat"] = repeat
            runs.append(row)
            own = (f", own code {1e3 * max(row['own_s']):.1f} ms + {row['own_collectives']} collectives x"
                   f" {1e3 * row['collective_latency_s']:.2f} ms (in the step {1e3 * min(row['own_comm_s']):.1f}"
                   f"-{1e3 * max(row['own_comm_s']):.1f} ms)" if "own_s" in row else "")
            print(f"  [{repeat}] {config:>14}: {row['step_s']:.3f} s/step, CPU {row['cpu_s']:.3f} s/step{own}"
                  f" (load {row['load_at_start']:.1f}; {time.time() - start:.0f} s)", flush=True)
    summary = summarize(runs, args)
    summary["runs"] = runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (out / "step_overhead.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

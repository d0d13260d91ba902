"""The memory planner against measured runs: per-rank peak predicted by ``lightning_ulysses.plan`` and measured in
fresh ``torchrun`` processes, over a grid of configurations, and the longest sequence under a budget.

    python benchmarks/plan_accuracy.py                        # the whole grid (about 25 minutes on 2 cores)
    python benchmarks/plan_accuracy.py --only ring moe        # rows whose name contains one of the texts
    python benchmarks/plan_accuracy.py --longest              # the longest-sequence checks only

Models (built from configs, small enough for a CPU): a dense GQA decoder (Llama: 8 query heads, 2 KV heads), a
mixture of experts (Qwen3-MoE, transformers' fused experts: 8 experts, 2 per token), a Qwen3.5-like hybrid
(``qwen3_5_text``: gated delta nets and full attention 3 : 1), and vision-language models (Qwen2.5-VL and Qwen3.5
with their vision towers, ``benchmarks/vlm_memory.py``'s: rows of text, an image and a 64-frame video, the plan
given the row's image and video grids). Each row trains 2 steps with SGD under
``UlyssesDeepSpeedStrategy`` (ZeRO 3 with ``stage3_param_persistence_threshold=0``: every parameter partitioned) and
measures the last step's peak as CUDA's ``max_memory_allocated`` counts it: the live tensor bytes when the step
starts (the model's states, DeepSpeed's buffers, the batch) plus the step's peak growth
(:class:`lightning_ulysses.TensorMemoryMonitor`), the largest over the ranks; the process's peak RSS growth beside it.

Checkpoint offload (and ``offload_attention``'s chunk store) on a CPU has no host to move to (the strategy keeps host tensors where they are): rows with
``offload_checkpoints=True`` run with the strategy's offload hooks moving each saved tensor's bytes out of torch (into
a NumPy array, back into a tensor in backward), as an accelerator's copy to pinned host memory does, so that the
device-side count is what a GPU would see.

The longest-sequence check: for a budget, the planner's longest sequence ``L``; the runs at ``0.9 L`` must fit and
at ``1.1 L`` must not (the measured longest is then within 10% of the predicted one).

Writes ``benchmarks/out/plan_accuracy.json`` (``plan_accuracy_partial.json`` with ``--only`` or ``--longest``) and
prints the table (docs/planning.md).
"""

from __future__ import annotations

import argparse
import gc
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
VOCAB = 8192
BUCKET = 5_000_000  # ZeRO's reduce/allgather bucket (elements): one bucket holds each model, as Lightning's 2e8 does

ALST = {"tiled_mlp": "auto", "tiled_loss": "auto", "offload_checkpoints": True}


def row(model: str, sp: int, seq_len: int, *, stage: int = 2, ring: int = 1, precision: str = "32-true",
        **switches) -> dict:
    parts = [model, f"sp{sp}"] + ([f"ring{ring}"] if ring > 1 else []) + [f"z{stage}", f"{seq_len // 1024}k"]
    parts += ["bf16"] if precision != "32-true" else []
    parts += [key.replace("_", "-") for key, value in switches.items() if value]
    return {"name": "-".join(parts), "model": model, "sp": sp, "ring": ring, "stage": stage, "seq_len": seq_len,
            "precision": precision, **switches}


GRID = [
    # a dense GQA decoder: sp, ring, ZeRO stage, each memory switch, precision, lengths 2K-32K
    row("dense", 1, 4096), row("dense", 2, 4096), row("dense", 4, 4096), row("dense", 1, 2048, precision="bf16-mixed"),
    row("dense", 2, 4096, stage=3), row("dense", 4, 8192, stage=3), row("dense", 2, 8192, stage=3,
                                                                         precision="bf16-mixed"),
    row("dense", 2, 4096, ring=2), row("dense", 4, 8192, ring=2), row("dense", 4, 8192, ring=4, stage=3),
    row("dense", 2, 8192, tiled_mlp="auto"), row("dense", 2, 8192, tiled_loss="auto"),
    row("dense", 2, 8192, gradient_checkpointing=True), row("dense", 2, 8192, offload_checkpoints=True),
    row("dense", 2, 16384, stage=3, **ALST), row("dense", 4, 32768, stage=3, **ALST),
    row("dense", 2, 8192, offload_attention=1024), row("dense", 4, 16384, stage=3, offload_attention=2048),
    row("dense", 2, 16384, stage=3, offload_attention=2048, **ALST),  # the layer checkpoint's path
    # a mixture of experts
    row("moe", 1, 2048), row("moe", 2, 4096), row("moe", 4, 8192, stage=3), row("moe", 2, 4096, ring=2),
    row("moe", 2, 8192, **ALST),
    # a Qwen3.5-like hybrid
    row("hybrid", 1, 2048), row("hybrid", 2, 4096), row("hybrid", 4, 8192, stage=3), row("hybrid", 2, 8192, **ALST),
    # vision-language models (the length is the sample's: text, an image, a 64-frame video)
    row("qwen2_5_vl", 1, 4080), row("qwen2_5_vl", 2, 4080), row("qwen2_5_vl", 2, 4080, stage=3),
    row("qwen3_5_vl", 2, 4580),
]
VISION_LANGUAGE = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_5_vl": "qwen3_5"}  # grid name: vlm_memory.py's family


def vlm_args(spec: dict):
    """``benchmarks/vlm_memory.py``'s settings for a vision-language row (3500 text tokens, a 64-frame video)."""
    return argparse.Namespace(hidden=256, layers=4, vision_hidden=128, family=VISION_LANGUAGE[spec["model"]],
                              text=3500, frames=64, frame_size=32, steps=2)
# the longest sequence under a budget: (the row's settings, the budget in MiB)
LONGEST = [(row("dense", 2, 0), 400), (row("dense", 4, 0, stage=3, **ALST), 160)]


def model_config(name: str, seq_len: int):
    """The Hugging Face config of a grid model (a dense GQA Llama, a Qwen3-MoE, a Qwen3.5-like hybrid)."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=256, num_attention_heads=8, head_dim=32,
                  max_position_embeddings=max(seq_len, 2048), pad_token_id=0, tie_word_embeddings=False)
    if name == "dense":
        return AutoConfig.for_model("llama", intermediate_size=1024, num_hidden_layers=4, num_key_value_heads=2,
                                    **common)
    if name == "moe":
        return AutoConfig.for_model("qwen3_moe", intermediate_size=1024, moe_intermediate_size=256,
                                    num_hidden_layers=2, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                    **common)
    if name in VISION_LANGUAGE:
        return None  # built by benchmarks/vlm_memory.py
    if name == "hybrid":
        return AutoConfig.for_model(
            "qwen3_5_text", intermediate_size=1024, num_hidden_layers=4, num_key_value_heads=2,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, **common)
    raise ValueError(f"unknown model {name!r}")


def plan_of(spec: dict, seq_len: int):
    from lightning_ulysses.plan import plan_memory

    config, grids = model_config(spec["model"], seq_len), None
    if spec["model"] in VISION_LANGUAGE:
        import torch
        import vlm_memory

        with torch.device("meta"):
            config = vlm_memory._model(vlm_args(spec)).config
        sample = vlm_memory._sample(vlm_args(spec), 0)
        grids = sample["image_grid_thw"].tolist() + sample["video_grid_thw"].tolist()
    return plan_memory(config, seq_len, sp_size=spec["sp"], ring_size=spec["ring"], vision_grids=grids,
                       stage=spec["stage"], precision=spec["precision"], optimizer="sgd", reduce_bucket_size=BUCKET,
                       persistence_threshold=0, tiled_mlp=spec.get("tiled_mlp", 0),
                       tiled_loss=spec.get("tiled_loss", 0), offload_checkpoints=spec.get("offload_checkpoints", False),
                       gradient_checkpointing=spec.get("gradient_checkpointing", False),
                       offload_attention=spec.get("offload_attention", False))


def _live_tensor_bytes() -> int:
    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            key = obj.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
    return total


def worker(spec: dict, result_dir: str) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from transformers import AutoModelForCausalLM

    from lightning_ulysses import TensorMemoryMonitor, UlyssesDeepSpeedStrategy

    import host_emulation

    if spec.get("offload_checkpoints"):
        host_emulation.checkpoints_on_a_host()
    if spec.get("offload_attention"):
        host_emulation.attention_chunks_on_a_host()
    seq_len, steps = spec["seq_len"], 2
    losses: list[float] = []
    starts: list[int] = []
    rss: dict[str, int] = {}

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            if spec["model"] in VISION_LANGUAGE:
                import vlm_memory

                self.model = vlm_memory._model(vlm_args(spec))
            else:
                self.model = AutoModelForCausalLM.from_config(model_config(spec["model"], seq_len),
                                                              attn_implementation="sdpa")
            if spec.get("gradient_checkpointing"):
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            rss["base"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == steps - 1:
                starts.append(_live_tensor_bytes() - before)

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(1, VOCAB, (steps, seq_len), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    collate = None
    if spec["model"] in VISION_LANGUAGE:
        import vlm_memory

        data, collate = [vlm_memory._sample(vlm_args(spec), seed) for seed in range(steps)], vlm_memory._first
        assert data[0]["input_ids"].shape[1] == seq_len, (data[0]["input_ids"].shape, seq_len)
    before = _live_tensor_bytes()
    strategy = UlyssesDeepSpeedStrategy(
        sp_size=spec["sp"], ring_size=spec["ring"], stage=spec["stage"], reduce_bucket_size=BUCKET,
        allgather_bucket_size=BUCKET, tiled_mlp=spec.get("tiled_mlp", 0), tiled_loss=spec.get("tiled_loss", 0),
        offload_checkpoints=spec.get("offload_checkpoints", False),
        offload_attention=spec.get("offload_attention", False), preflight="off")
    if spec["stage"] == 3:
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    monitor = TensorMemoryMonitor()
    Trainer(accelerator="cpu", devices=spec["sp"], max_steps=steps, strategy=strategy, precision=spec["precision"],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[monitor, Start()]).fit(Module(), torch.utils.data.DataLoader(data, batch_size=1,
                                                                                       collate_fn=collate))
    last = monitor.steps[-1]
    result = {"start": starts[-1], "step": last.peak_bytes, "peak": starts[-1] + last.peak_bytes, "losses": losses,
              "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss["base"]}
    Path(result_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(spec: dict, timeout: int = 1800) -> dict:
    """One configuration in fresh processes: the largest per-rank peak (and its parts) over the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={spec['sp']}", "--master_port",
               str(_free_port()), __file__, "--worker", json.dumps(spec), "--result-dir", tmp]
        env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ, "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // spec["sp"]))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != spec["sp"]:
            raise RuntimeError(f"{spec['name']} failed:\n{proc.stderr[-4000:]}")
        ranks = [json.loads(f.read_text()) for f in files]
    top = max(ranks, key=lambda r: r["peak"])
    return {**top, "rss_growth": max(r["rss_growth"] for r in ranks)}


def compare(spec: dict) -> dict:
    started = time.time()
    measured = measure(spec)
    plan = plan_of(spec, spec["seq_len"])
    predicted = plan.peak
    return {**spec, "measured": measured["peak"], "measured_start": measured["start"],
            "measured_step": measured["step"], "predicted": predicted, "predicted_states": plan.states.total,
            "predicted_step": plan.step + plan.zero3_gathered, "error": predicted / measured["peak"] - 1,
            "rss_growth": measured["rss_growth"], "loss": measured["losses"][0], "seconds": time.time() - started}


def longest(spec: dict, budget_mib: int) -> dict:
    from lightning_ulysses.plan import longest_sequence

    settings = dict(sp_size=spec["sp"], ring_size=spec["ring"], stage=spec["stage"], precision=spec["precision"],
                    optimizer="sgd", reduce_bucket_size=BUCKET, persistence_threshold=0,
                    tiled_mlp=spec.get("tiled_mlp", 0), tiled_loss=spec.get("tiled_loss", 0),
                    offload_checkpoints=spec.get("offload_checkpoints", False))
    budget = budget_mib * MIB
    predicted = longest_sequence(model_config(spec["model"], 1 << 16), budget, multiple=256, **settings)
    found = {"name": spec["name"] + f"-under-{budget_mib}MiB", "budget": budget, "predicted_longest": predicted}
    for share in (0.9, 1.1):
        length = int(predicted * share) // (2 * spec["sp"]) * (2 * spec["sp"])
        peak = measure({**spec, "seq_len": length})["peak"]
        found[f"at_{share}"] = {"seq_len": length, "measured": peak, "fits": peak <= budget}
    found["within_10_percent"] = found["at_0.9"]["fits"] and not found["at_1.1"]["fits"]
    return found


def table(rows: list[dict]) -> str:
    lines = ["| configuration | measured peak MiB/rank (start + step) | predicted MiB (states + step) | error |"
             " RSS growth MiB |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['measured'] / MIB:.1f} ({r['measured_start'] / MIB:.1f} +"
                     f" {r['measured_step'] / MIB:.1f}) | {r['predicted'] / MIB:.1f}"
                     f" ({r['predicted_states'] / MIB:.1f} + {r['predicted_step'] / MIB:.1f}) | {100 * r['error']:+.1f}%"
                     f" | {r['rss_growth'] / MIB:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="run the rows whose name contains one of these texts")
    parser.add_argument("--longest", action="store_true", help="only the longest-sequence checks")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.result_dir)
        return
    OUT.mkdir(exist_ok=True)
    rows: list[dict] = []
    checks: list[dict] = []
    if not args.longest:
        for spec in GRID:
            if args.only and not any(text in spec["name"] for text in args.only):
                continue
            rows.append(compare(spec))
            r = rows[-1]
            print(f"  {r['name']}: measured {r['measured'] / MIB:.1f} MiB, predicted {r['predicted'] / MIB:.1f} MiB"
                  f" ({100 * r['error']:+.1f}%), {r['seconds']:.0f} s", flush=True)
    if args.longest or not args.only:
        for spec, budget in LONGEST:
            checks.append(longest(spec, budget))
            print(f"  {json.dumps(checks[-1])}", flush=True)
    name = "plan_accuracy.json" if not (args.only or args.longest) else "plan_accuracy_partial.json"
    (OUT / name).write_text(json.dumps({"rows": rows, "longest": checks}, indent=1))
    if rows:
        print(table(rows))
        worst = max(abs(r["error"]) for r in rows)
        print(f"{len(rows)} configurations, largest error {100 * worst:.1f}%")
    for c in checks:
        print(f"{c['name']}: predicted longest {c['predicted_longest']}; at 0.9x {c['at_0.9']['measured'] / MIB:.1f}"
              f" MiB ({'fits' if c['at_0.9']['fits'] else 'over'}), at 1.1x {c['at_1.1']['measured'] / MIB:.1f} MiB"
              f" ({'fits' if c['at_1.1']['fits'] else 'over'})")


if __name__ == "__main__":
    main()

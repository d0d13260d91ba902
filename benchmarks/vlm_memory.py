"""Per-rank peak training memory and vision-encoder time of a vision-language model under SP, at sp = 1, 2, 4.

One long multimodal sample: a synthetic ``--frames``-frame video and an image between ``--text`` text tokens, a
``--family`` model built from a config (``--hidden``, ``--layers``; vision tower ``--vision-hidden`` wide), SGD, ZeRO
2, ``--steps`` steps. Families: Qwen2.5-VL (the video one run of placeholders) and Qwen3.5 (decoder layers of gated
delta nets, every fourth one gated attention as in the released models; the video written per temporal patch as its
processor does, ``<t seconds> <vision_start> placeholders <vision_end>``, a few more text tokens). Each sp runs in
fresh processes (``torchrun``). Memory as in ``benchmarks/sweep.py``: on CPU the growth of the process's peak RSS
from just before the first step to the end, the largest over the ranks; the vision-encoder time is the forward time
of the vision tower per rank and step (its backward is not separable).

    python benchmarks/vlm_memory.py                     # CPU, sp = 1, 2, 4 (4 processes), a few minutes
    python benchmarks/vlm_memory.py --sp 1 2 --frames 32
    python benchmarks/vlm_memory.py --family qwen3_5    # writes results/vlm_memory_qwen3_5.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE, VIDEO, START, END = 1020, 1021, 1022, 1023  # text tokens are below 1000
FPS = 2.0  # the synthetic video's frame rate (Qwen3.5's timestamps)
FAMILIES = ("qwen2_5_vl", "qwen3_5")
CPU_MMAP_THRESHOLD = "131072"  # a fixed glibc threshold: large tensors map and unmap (see sweep.py)


def _args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--frame-size", type=int, default=32, help="frame height and width in pixels")
    parser.add_argument("--text", type=int, default=6144, help="text tokens around the image and the video")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vision-hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--sp-size", type=int, default=1)
    parser.add_argument("--result-dir", default="")
    return parser.parse_args(argv)


def _model(args):
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3_5Config

    heads = max(4, args.hidden // 64)
    text = dict(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=4 * (args.text + args.frames * 64),
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=args.vision_hidden, num_heads=4, intermediate_size=2 * args.vision_hidden,
                  out_hidden_size=args.hidden, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, in_channels=3)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if args.family == "qwen3_5":
        head_dim = args.hidden // heads
        # interleaved M-RoPE on a quarter of each head (the released models' partial rotary factor): head_dim / 8
        # frequencies shared by time, height and width
        frequencies = head_dim // 8
        sections = [-(-frequencies // 3), -(-(frequencies - -(-frequencies // 3)) // 2)]
        rope = {"rope_type": "default", "mrope_interleaved": True, "partial_rotary_factor": 0.25,
                "mrope_section": sections + [frequencies - sum(sections)], "rope_theta": 10000.0}
        mixers = dict(linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=head_dim,
                      linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)  # full attention every 4th layer
        config = Qwen3_5Config(text_config=dict(text, head_dim=head_dim, rope_parameters=rope, **mixers),
                               vision_config=dict(vision, num_position_embeddings=256), **tokens)
    else:
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, window_size=16,
                                                                       fullatt_block_indexes=[1]), **tokens)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")


def _video_ids(args, grid) -> list[int]:
    """The video's tokens: one run of placeholders (Qwen2.5-VL), or per temporal patch ``<t seconds> <start>
    placeholders <end>`` (Qwen3.5; the timestamp one text token per character, as there is no tokenizer)."""
    patches, height, width = grid[0].tolist()
    per_patch = height * width // MERGE ** 2
    if args.family != "qwen3_5":
        return [START] + [VIDEO] * (patches * per_patch) + [END]
    ids = []
    for patch in range(patches):
        seconds = (patch * TEMPORAL + (TEMPORAL - 1) / 2) / FPS  # the mean time of the patch's frames
        ids += [ord(c) for c in f"<{seconds:.1f} seconds>"] + [START] + [VIDEO] * per_patch + [END]
    return ids


def _sample(args, seed: int) -> dict:
    """Text, an image (a 64×64 patch grid's worth), text, the video, text: one row, labels on text tokens only."""
    import torch

    g = torch.Generator().manual_seed(seed)
    side = args.frame_size // PATCH
    video_grid = torch.tensor([[args.frames // TEMPORAL, side, side]])
    image_grid = torch.tensor([[1, 16, 16]])
    width = 3 * TEMPORAL * PATCH * PATCH
    third = args.text // 3
    ids = torch.cat([
        torch.randint(0, 1000, (third,), generator=g), torch.tensor([START]),
        torch.full((int(image_grid.prod()) // MERGE ** 2,), IMAGE), torch.tensor([END]),
        torch.randint(0, 1000, (third,), generator=g), torch.tensor(_video_ids(args, video_grid)),
        torch.randint(0, 1000, (args.text - 2 * third,), generator=g)])[None]
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    return {"input_ids": ids, "labels": ids.masked_fill(ids >= 1000, -100), "mm_token_type_ids": types,
            "pixel_values": torch.randn(int(image_grid.prod()), width, generator=g), "image_grid_thw": image_grid,
            "pixel_values_videos": torch.randn(int(video_grid.prod()), width, generator=g),
            "video_grid_thw": video_grid}


def _first(items: list) -> dict:
    return items[0]  # each item is a whole batch of one row


def worker(args) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    state = {"base": 0, "vision": [], "vision_rows": [], "start": 0.0, "steps": []}

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(args)
            visual = self.model.model.visual
            def started(module, args) -> None:
                state["v0"] = time.perf_counter()
                state["vision_rows"].append(int(args[0].shape[0]))

            visual.register_forward_pre_hook(started)
            visual.register_forward_hook(lambda *a: state["vision"].append(time.perf_counter() - state["v0"]))

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            state["base"], state["start"] = rss(), time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            state["steps"].append(now - state["start"])
            state["start"] = now

    samples = [_sample(args, seed) for seed in range(args.steps)]
    trainer = Trainer(accelerator="cpu", devices=args.sp_size, max_steps=args.steps,
                      strategy=UlyssesDeepSpeedStrategy(sp_size=args.sp_size, stage=2), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Probe()])
    trainer.fit(Module(), torch.utils.data.DataLoader(samples, batch_size=1, collate_fn=_first))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - state["base"]
    result = {"peak_bytes": peak, "vision_s": state["vision"], "step_s": state["steps"],
              "vision_rows": state["vision_rows"],
              "tokens": int(samples[0]["input_ids"].shape[1])}
    Path(args.result_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


def run_one(args, sp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_port",
               str(29700 + sp), __file__, "--worker", "--sp-size", str(sp), "--result-dir", tmp,
               "--frames", str(args.frames), "--frame-size", str(args.frame_size), "--text", str(args.text),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--vision-hidden",
               str(args.vision_hidden), "--steps", str(args.steps), "--family", args.family]
        env = {"MALLOC_MMAP_THRESHOLD_": CPU_MMAP_THRESHOLD, **os.environ,
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // sp))}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != sp:
            raise RuntimeError(f"sp={sp} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in files]
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return {"sp": sp, "tokens": ranks[0]["tokens"], "peak_mib_per_rank": max(r["peak_bytes"] for r in ranks) / 2**20,
            "vision_forward_s_per_rank": max(median(r["vision_s"][1:] or r["vision_s"]) for r in ranks),
            # patches each rank's vision tower encodes per step (image call + video call; a dummy item is 4)
            "vision_patches_per_rank": [sum(r["vision_rows"]) // max(len(r["step_s"]), 1) for r in ranks],
            "step_s": median(ranks[0]["step_s"][1:] or ranks[0]["step_s"])}


def main() -> None:
    args = _args()
    if args.worker:
        worker(args)
        return
    rows = []
    for sp in args.sp:
        row = run_one(args, sp)
        rows.append(row)
        print(f"sp={sp}: {row['tokens']} tokens, {row['peak_mib_per_rank']:.0f} MiB/rank peak, vision forward"
              f" {row['vision_forward_s_per_rank'] * 1e3:.0f} ms/rank (patches per rank"
              f" {row['vision_patches_per_rank']}), step {row['step_s']:.2f} s", flush=True)
    base = next((r for r in rows if r["sp"] == 1), None)
    if base is not None:
        for row in rows:
            row["memory_vs_sp1"] = row["peak_mib_per_rank"] / base["peak_mib_per_rank"]
            row["vision_time_vs_sp1"] = row["vision_forward_s_per_rank"] / base["vision_forward_s_per_rank"]
            print(f"sp={row['sp']}: memory {row['memory_vs_sp1']:.2f}x, vision time {row['vision_time_vs_sp1']:.2f}x"
                  " of sp=1")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("vlm_memory.json" if args.family == "qwen2_5_vl" else f"vlm_memory_{args.family}.json")
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "result_dir")},
                               "rows": rows}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()

"""``python -m lightning_ulysses.plan``: the per-rank memory plan of a training run, before it starts.

    python -m lightning_ulysses.plan --config path/to/config.json --seq-len 131072 --sp 1 2 4 8 --gpus 8 --device h100
    python -m lightning_ulysses.plan --model-type llama --hidden-size 4096 --layers 32 --heads 32 --kv-heads 8 \\
        --intermediate-size 14336 --vocab-size 128256 --seq-len 65536 --sp 8 --stage 3 --longest --json

Prints each sp's breakdown (GiB per rank), whether it fits the device, and with ``--longest`` the longest sequence
that fits; ``--json`` prints the same as JSON (bytes). No network, no weights: the model is built on the meta device.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_ulysses.plan.cost import recommend, step_cost
from lightning_ulysses.plan.planner import DEVICES, GIB, longest_sequence, plan_memory


def _config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    if args.litgpt:  # a LitGPT model: a name LitGPT knows (its configs ship with it) or a model_config.yaml
        from litgpt.config import Config

        return Config.from_file(args.litgpt) if Path(args.litgpt).is_file() else Config.from_name(args.litgpt)
    if args.config:
        path = Path(args.config)
        if path.is_dir():
            return AutoConfig.from_pretrained(path)
        values = json.loads(path.read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if not args.model_type:
        raise SystemExit("give --config (a config.json or a folder with one), --litgpt, or --model-type with sizes")
    sizes = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate_size,
             "vocab_size": args.vocab_size}
    return AutoConfig.for_model(args.model_type, **{k: v for k, v in sizes.items() if v is not None})


def _tiles(value: str) -> Any:
    return value if value == "auto" else int(value)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ulysses.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a transformers config.json, or a folder holding one")
    parser.add_argument("--model-type", help="a transformers model type (with the sizes below)")
    parser.add_argument("--litgpt", help="a LitGPT model: a name LitGPT knows (e.g. Llama-3.1-8B) or a"
                                         " model_config.yaml")
    for flag in ("--hidden-size", "--layers", "--heads", "--kv-heads", "--intermediate-size", "--vocab-size"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    parser.add_argument("--sp", type=int, nargs="+", default=[1], help="sp_size values to plan")
    parser.add_argument("--gpus", type=int, help="ranks in all (default: each sp)")
    parser.add_argument("--device", choices=sorted(DEVICES), help="the device whose memory is the budget")
    parser.add_argument("--memory-gib", type=float, help="the budget per rank instead of --device's memory")
    parser.add_argument("--host-memory-gib", type=float,
                        help="--longest: also the host memory per rank the offloaded states and checkpoints may take")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "sgd_momentum"))
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-parameters", action="store_true",
                        help="ZeRO 3's offload_param to the CPU (modeled, not measured)")
    parser.add_argument("--ring", type=int, default=1, help="the strategy's ring_size (divides each --sp)")
    parser.add_argument("--offload-attention", type=int, default=0, metavar="CHUNK",
                        help="the strategy's offload_attention: positions per chunk (0: off)")
    parser.add_argument("--vision-grids", nargs="+", metavar="T,H,W", default=[],
                        help="a vision-language --config (Qwen-VL-style tower): the row's images and videos as the"
                             " processor's grids in patches, e.g. 1,32,32 16,24,24")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--reduce-bucket-size", type=int, default=200_000_000)
    parser.add_argument("--reserved-gib", type=float, default=0.0,
                        help="memory per rank to set aside beyond --device's fixed cost (its CUDA context, cuBLAS"
                             " and NCCL: 1.3 GiB, measured on an H100, already taken from its budget)")
    parser.add_argument("--tiled-mlp", default="0", help="the strategy's tiled_mlp: a tile count or auto")
    parser.add_argument("--tiled-loss", default="0", help="the strategy's tiled_loss: a chunk count or auto")
    parser.add_argument("--offload-checkpoints", action="store_true", help="the strategy's offload_checkpoints")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the model's gradient_checkpointing_enable()")
    parser.add_argument("--longest", action="store_true", help="also find the longest sequence that fits")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of tables")
    parser.add_argument("--plot", metavar="FILE", help="also write a plot of the planned peak against the sequence"
                        " length (seq-len/8 to seq-len x 4), a line per --sp, the budget drawn (needs matplotlib)")
    parser.add_argument("--recommend", action="store_true",
                        help="rank every setting that fits --device (sp, ZeRO 2/3, memory switches, optimizer offload)"
                             " by estimated throughput, on --gpus-per-node x --nodes devices")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args(argv)
    if args.recommend:
        return _recommend(args)
    config = _config(args)
    budget = (int(args.memory_gib * GIB) if args.memory_gib else
              DEVICES[args.device].tensor_bytes if args.device else None)
    found = []

    def settings_for(sp: int) -> dict:
        return dict(sp_size=sp, world_size=args.gpus or sp, stage=args.stage, precision=args.precision,
                    micro_batch=args.micro_batch, optimizer=args.optimizer, offload_optimizer=args.offload_optimizer,
                    reduce_bucket_size=args.reduce_bucket_size, reserved_bytes=int(args.reserved_gib * GIB),
                    tiled_mlp=_tiles(args.tiled_mlp), tiled_loss=_tiles(args.tiled_loss),
                    offload_checkpoints=args.offload_checkpoints, gradient_checkpointing=args.gradient_checkpointing,
                    ring_size=args.ring, offload_parameters=args.offload_parameters,
                    offload_attention=args.offload_attention or False,
                    vision_grids=[tuple(int(n) for n in grid.split(",")) for grid in args.vision_grids] or None)

    for sp in args.sp:
        settings = settings_for(sp)
        try:
            plan = plan_memory(config, args.seq_len, **settings)
        except ValueError as err:
            found.append({"sp_size": sp, "error": str(err)})
            continue
        entry = plan.to_dict()
        try:  # the step's FLOPs and bytes sent per rank (dense decoders)
            entry["step_cost"] = asdict(step_cost(config, args.seq_len, sp_size=sp, world_size=args.gpus or sp,
                                                  stage=args.stage, precision=args.precision,
                                                  micro_batch=args.micro_batch, parameters=plan.parameters,
                                                  ring_size=args.ring,
                                                  recompute=args.offload_checkpoints or args.gradient_checkpointing))
        except ValueError as err:
            entry["step_cost"] = str(err)
        if budget is not None:
            entry["budget"], entry["fits"] = budget, plan.peak <= budget
            if args.longest:
                entry["longest_seq_len"] = longest_sequence(
                    config, budget, host_budget_bytes=int(args.host_memory_gib * GIB) if args.host_memory_gib else None,
                    **settings)
        found.append(entry)
        if not args.json:
            print(plan.table())
            if isinstance(entry["step_cost"], dict):
                cost = entry["step_cost"]
                ring = (f", {cost['ring_bytes'] / GIB:.2f} GiB in the ring's passes" if cost["ring_bytes"] else "")
                print(f"step per rank: {cost['flops'] / 1e12:.1f} TFLOPs, sends {cost['all_to_all_bytes'] / GIB:.2f}"
                      f" GiB in the all-to-alls{ring} and {cost['zero_bytes'] / GIB:.2f} GiB in ZeRO's collectives")
            if budget is not None:
                verdict = "fits" if plan.peak <= budget else "does NOT fit"
                print(f"{verdict} in {budget / GIB:.1f} GiB per rank"
                      + (f"; longest sequence that fits: {entry['longest_seq_len']}" if args.longest else ""))
            print()
    if args.plot:
        from lightning_ulysses.plan.plot import plot_lengths, plot_peaks

        def plan_of(sp: int, length: int):
            return plan_memory(config, length, **settings_for(sp))

        plot_peaks(plan_of, plot_lengths(args.seq_len, args.sp), args.sp, budget, args.plot,
                   f"{getattr(config, 'model_type', 'model')}, ZeRO {args.stage}, {args.precision}")
        if not args.json:
            print(f"wrote {args.plot}")
    if args.json:
        json.dump(found, sys.stdout, indent=1, default=str)
        print()
    else:
        for entry in found:
            if "error" in entry:
                print(f"sp={entry['sp_size']}: {entry['error']}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    if not args.device:
        raise SystemExit("--recommend needs --device (its memory is the budget unless --memory-gib is given)")
    config = _config(args)
    budget = int(args.memory_gib * GIB) if args.memory_gib else None
    ranked = recommend(config, args.seq_len, devices_per_node=args.gpus_per_node, nodes=args.nodes,
                       device=args.device, budget_bytes=budget, precision=args.precision,
                       micro_batch=args.micro_batch, optimizer=args.optimizer)
    if args.json:
        json.dump([{"strategy": r.strategy_arguments(), "peak": r.plan.peak, "step_seconds": r.seconds,
                    "tokens_per_second": r.tokens_per_second} for r in ranked], sys.stdout, indent=1)
        print()
        return 0
    if not ranked:
        print(f"Nothing fits {args.seq_len} tokens on {args.gpus_per_node} x {args.nodes} {args.device}: try a"
              " shorter sequence, more devices, or ring attention.")
        return 0
    print(f"S={args.seq_len} on {args.gpus_per_node} x {args.nodes} {args.device}, {args.precision}: for each sp and"
          " ZeRO stage the quickest way to fit, highest estimated throughput first")
    print("| UlyssesDeepSpeedStrategy(...) | peak GiB per rank | est. step s | est. tokens/s (world) |")
    print("|---|---|---|---|")
    for r in ranked[:12]:
        arguments = ", ".join(f"{k}={v!r}" for k, v in r.strategy_arguments().items())
        print(f"| {arguments} | {r.plan.peak / GIB:.1f} | {r.seconds:.2f} | {r.tokens_per_second:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

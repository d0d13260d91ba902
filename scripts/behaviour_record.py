"""Record what the parity trainings produce (per-step losses and trained weights) so that a redesign can be checked
to change no behaviour: record before, record after, compare bitwise.

    python scripts/behaviour_record.py record before.pt        # in the checkout before the change
    python scripts/behaviour_record.py record after.pt         # in the checkout after it
    python scripts/behaviour_record.py compare before.pt after.pt

The trainings (real gloo processes, the test suite's launcher and scenarios of the checkout it runs in): SP=2 at
ZeRO 0-3 with MHA/GQA/MQA, a training_step with its own loss, rows with an empty shard, gradient clipping, DP=2 × SP=2
at ZeRO 2/3, ring 2 × Ulysses 1, and a hybrid (gated delta net) model; about 3 minutes on the 2-core machine.
``compare`` prints, per training, whether losses and weights are bitwise equal, else the largest relative difference,
and exits 1 if any differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _trainings() -> dict[str, tuple[int, str, dict]]:
    from tests.support.training import FitSpec

    def fit(stage: int, kv: int, sp: int = 2, batch: int = 1, rows: int = 4, **options) -> FitSpec:
        return FitSpec(stage=stage, kv_heads=kv, sp_size=sp, batch_size=batch, steps=4, seq_len=32, num_rows=rows,
                       lr=0.5, **options)

    sp2 = [fit(stage, kv) for stage in (0, 1, 2, 3) for kv in (4, 2, 1)]
    variants = [fit(2, 2, own_loss=True), fit(3, 2, ignore_after=16), fit(2, 2, trainer={"gradient_clip_val": 0.05})]
    dp2 = [fit(stage, 2, batch=2, rows=16) for stage in (2, 3)]
    ring = [fit(2, 2, strategy={"ring_size": 2})]
    return {"sp2": (2, "parity:run", {"runs": sp2}), "variants": (2, "parity:run", {"runs": variants}),
            "dp2_sp2": (4, "parity:run", {"runs": dp2}), "ring2": (2, "parity:run", {"runs": ring}),
            "hybrid": (2, "architectures:run", {"names": ["qwen3_5_text"], "steps": 3, "lr": 0.1, "stage": 2})}


def record(path: str) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.support.launcher import launch

    recorded = {}
    for name, (procs, scenario, payload) in _trainings().items():
        recorded[name] = launch(procs, scenario, payload)[0]
        print(f"[behaviour] {name}: recorded", flush=True)
    torch.save(recorded, path)


def _tensors(value, prefix: str = ""):
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key], f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{i}]")
    elif isinstance(value, float):
        yield prefix, torch.tensor(value, dtype=torch.float64)


def compare(before_path: str, after_path: str) -> int:
    before, after = torch.load(before_path, weights_only=False), torch.load(after_path, weights_only=False)
    differing = 0
    for name in before:
        left, right = dict(_tensors(before[name])), dict(_tensors(after.get(name)))
        if left.keys() != right.keys():
            print(f"{name}: different results ({sorted(left.keys() ^ right.keys())[:4]})")
            differing += 1
            continue
        unequal = {key: float(((left[key].double() - right[key].double()).norm()
                               / left[key].double().norm().clamp_min(1e-30)))
                   for key in left if not torch.equal(left[key], right[key])}
        print(f"{name}: {len(left)} tensors, " + ("bitwise equal" if not unequal else
              f"{len(unequal)} differ, largest relative difference {max(unequal.values()):.2e}"))
        differing += bool(unequal)
    return 1 if differing else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"] and len(sys.argv) == 3:
        record(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)

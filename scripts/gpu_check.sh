#!/usr/bin/env bash
# Every CUDA path of the project in one command, with a report:
#
#   bash scripts/gpu_check.sh            # on a machine with 1 or more NVIDIA GPUs (about 10 minutes on one H100)
#
# 1. sets up .venv (scripts/setup_env.sh; on a GPU machine the torch pin resolves to the CUDA build) and tries to
#    install flash-attn from a prebuilt wheel (no compilation: skipped cleanly when none matches);
# 2. runs tests/test_cuda.py (each CUDA path against one GPU the way the CPU tests do; cases that need more GPUs
#    than there are skip with their reason);
# 3. runs the GPU sweep of benchmarks/sweep.py (tokens/s and peak memory per rank, sp over the GPUs there are);
# 4. writes benchmarks/results/gpu/report.md (+ junit.xml, sweep.csv, environment.txt): pass/fail per path,
#    tokens/s, peak memory per rank, MFU where the GPU's peak is known, and the memory planner's step against each
#    row's measured max_memory_allocated growth (lightning_ulysses.plan, docs/planning.md).
#
# On a machine without a GPU it checks nothing, prints a one-line summary and exits 0 (CI machines have none).
# Environment: GPU_CHECK_LENGTHS (sweep sequence lengths, default "16384 32768"), GPU_CHECK_SKIP_SWEEP=1,
# GPU_CHECK_CONFIGS (the sweep's configurations, default "plain alst offload alst-offload"), GPU_CHECK_LONG_LENGTHS
# (default "131072": the memory switches alone at lengths where activations set their peak; "" skips), GPU_CHECK_PYTEST_ARGS
# (added to pytest's, e.g. "-k 'not flex'": the flex_attention cases compile for about 110 s each on an H100),
# GPU_CHECK_PYTHON: an interpreter that already has the stack (a machine with no package index, e.g. torch from the
# machine's image and the rest from carried wheels on PYTHONPATH): no .venv is made, nothing is installed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/benchmarks/results/gpu"
REPORT="$OUT/report.md"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
fi
if [[ "$gpus" -eq 0 ]]; then
    echo "[gpu_check] summary: no NVIDIA GPU here, nothing checked, no report written (the CPU paths are tested by"
    echo "[gpu_check] bash scripts/run_tests.sh). Run this on a GPU machine."
    exit 0
fi
mkdir -p "$OUT"
{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs))"
} > "$REPORT"

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    PY="$GPU_CHECK_PYTHON"
    echo "Python: $PY as it is (GPU_CHECK_PYTHON; no .venv set up)" >> "$REPORT"
else
    bash "$ROOT/scripts/setup_env.sh" || { echo "setup failed" | tee -a "$REPORT"; exit 1; }
    PY="${VENV_DIR:-$ROOT/.venv}/bin/python"
fi
nvidia-smi > "$OUT/environment.txt" 2>&1
"$PY" -c "from lightning_ulysses.drift.guard import installed_versions; print(installed_versions())" >> "$OUT/environment.txt" 2>&1
"$PY" -m pip list 2>/dev/null | grep -Ei "^(torch|deepspeed|lightning|transformers|flash|triton) " >> "$OUT/environment.txt"
echo "Versions: $(tail -n +1 "$OUT/environment.txt" | grep -E "^\{" | head -1)" >> "$REPORT"

# flash-attn: only a prebuilt wheel (building from source takes an hour); a miss is not a failure.
if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    "$PY" -c "import flash_attn" 2>/dev/null && echo "flash-attn: present" >> "$REPORT" \
        || echo "flash-attn: not installed (GPU_CHECK_PYTHON: no install tried): flash_attention_2 cases skip" >> "$REPORT"
elif ! "$PY" -c "import flash_attn" 2>/dev/null; then
    if timeout 300 "$PY" -m pip install -qq --only-binary=:all: flash-attn 2>/dev/null; then
        echo "flash-attn: installed from a wheel" | tee -a "$REPORT"
    else
        echo "flash-attn: no prebuilt wheel for this torch/CUDA/Python: flash_attention_2 cases skip" | tee -a "$REPORT"
    fi
fi

cd "$ROOT"
rc=0
# shellcheck disable=SC2086
"$PY" -m pytest tests/test_cuda.py ${GPU_CHECK_PYTEST_ARGS:-} -v -rs --junitxml="$OUT/junit.xml" > "$OUT/test_cuda.log" 2>&1 \
    || rc=$?
{
    echo
    echo "## tests/test_cuda.py (exit $rc)"
    echo
    echo '```'
    grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/test_cuda.log" | sed 's/^tests\/test_cuda.py:://' | head -100
    tail -1 "$OUT/test_cuda.log"
    echo '```'
} >> "$REPORT"

if [[ "${GPU_CHECK_SKIP_SWEEP:-0}" != "1" ]]; then
    sps=$("$PY" -c "n=$gpus; print(' '.join(str(s) for s in (1, 2, 4, 8) if s <= n))")
    lengths="${GPU_CHECK_LENGTHS:-16384 32768}"
    # shellcheck disable=SC2086
    model_flags=(--hidden 2048 --layers 8 --heads 16 --vocab 32000)  # the swept model (MFU counts its parameters)
    if "$PY" benchmarks/sweep.py --lengths $lengths --sp $sps "${model_flags[@]}" \
            --configs ${GPU_CHECK_CONFIGS:-plain alst offload alst-offload} --steps 5 --max-length 0 \
            > "$OUT/sweep.log" 2>&1; then
        cp benchmarks/out/sweep.csv "$OUT/sweep.csv"
        # the memory switches at a length where activations, not the model's states, set their peak (the plain
        # configurations do not fit there): appended to the same table
        long_lengths="${GPU_CHECK_LONG_LENGTHS-131072}"
        if [[ -n "$long_lengths" ]]; then
            # shellcheck disable=SC2086
            if "$PY" benchmarks/sweep.py --lengths $long_lengths --sp $sps "${model_flags[@]}" \
                    --configs alst alst-offload --steps 3 --max-length 0 >> "$OUT/sweep.log" 2>&1; then
                tail -n +2 benchmarks/out/sweep.csv >> "$OUT/sweep.csv"
            else
                echo "(the long-sequence sweep at $long_lengths failed: sweep.log)" >> "$REPORT"
            fi
        fi
        {
            echo
            echo "## benchmarks/sweep.py (hidden 2048, 8 layers, 16 heads, bf16 on CUDA)"
            echo
            "$PY" - "$OUT/sweep.csv" "${model_flags[@]}" <<'EOF'
import argparse, csv, sys
import torch
sys.path.insert(0, "benchmarks")
from sweep import _model  # the sweep's own model builder: the FLOPs follow the model it trained
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s per GPU
name = torch.cuda.get_device_name(0)
peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
flags = argparse.ArgumentParser()
for flag in ("--hidden", "--layers", "--heads", "--vocab"):
    flags.add_argument(flag, type=int)
shape = flags.parse_args(sys.argv[2:])
with torch.device("meta"):  # shapes only, no memory
    model = _model(argparse.Namespace(arch="llama", seq_len=2048, **vars(shape)))
# 6·N FLOPs per token (forward 2·N, backward 4·N) for the N parameters that multiply activations: every nn.Linear
# (q/k/v/o, the SwiGLU MLP's gate/up/down, the LM head), not the embedding lookup or the norms' scales.
matmul_params = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
config = model.config
layers, attention_width = config.num_hidden_layers, config.num_attention_heads * model.model.layers[0].self_attn.head_dim
print(f"Model: {matmul_params / 1e6:.0f} M matmul parameters ({layers} layers, attention width {attention_width});"
      " training FLOPs per token = 6 · that + 12 · layers · width · S (attention scores and values, S x S per layer)")
print()
print("| config | sp | seq_len | peak MiB/rank | tokens/s | MFU |")
print("|---|---|---|---|---|---|")
for r in csv.DictReader(open(sys.argv[1])):
    tokens, S = float(r["tokens_per_s"]), int(r["seq_len"])
    flops = tokens * (6 * matmul_params + 12 * layers * attention_width * S)  # training FLOPs: weights + attention
    mfu = f"{flops / (peak * int(r['sp'])):.1%}" if peak else "n/a"
    print(f"| {r['config']} | {r['sp']} | {S} | {float(r['peak_mib_per_rank']):.0f} | {tokens:.0f} | {mfu} |")
EOF
            echo
            echo "## The memory planner against CUDA's max_memory_allocated (the sweep's rows)"
            echo
            "$PY" - "$OUT/sweep.csv" "${model_flags[@]}" <<'EOF'
import argparse, csv, sys
import torch
sys.path.insert(0, "benchmarks")
from sweep import SWITCHES, _model
from lightning_ulysses.plan import plan_memory
flags = argparse.ArgumentParser()
for flag in ("--hidden", "--layers", "--heads", "--vocab"):
    flags.add_argument(flag, type=int)
shape = flags.parse_args(sys.argv[2:])
with torch.device("meta"):
    config = _model(argparse.Namespace(arch="llama", seq_len=2048, **vars(shape))).config
print("The sweep measures the growth of max_memory_allocated from the start of training (the states are already"
      " there): against it, the plan's step (ZeRO 2, bf16, SGD, buckets 2e8, the row's switches).")
print()
print("Whole peak: max_memory_allocated against the plan's peak without the device's fixed cost (states + step).")
print()
print("| config | sp | seq_len | measured step MiB | planned step MiB | difference | measured peak MiB |"
      " planned peak MiB | difference |")
print("|---|---|---|---|---|---|---|---|---|")
fixed = []
for r in csv.DictReader(open(sys.argv[1])):
    if r["config"] not in SWITCHES:
        continue
    sp, S = int(r["sp"]), int(r["seq_len"])
    plan = plan_memory(config, S, sp_size=sp, world_size=sp, stage=2, precision="bf16-mixed", optimizer="sgd",
                       **SWITCHES[r["config"]])
    measured = float(r["peak_mib_per_rank"])
    planned = (plan.states.total + plan.step) / 2**20
    whole = float(r["max_allocated_mib"]) if r.get("max_allocated_mib") else None  # not read: an older sweep
    peak_cells = f"{whole:.0f} | {planned:.0f} | {planned / whole - 1:+.1%}" if whole else f"— | {planned:.0f} | —"
    print(f"| {r['config']} | {sp} | {S} | {measured:.0f} | {plan.step / 2**20:.0f} |"
          f" {plan.step / 2**20 / measured - 1:+.1%} | {peak_cells} |")
    if r.get("max_reserved_mib"):
        fixed.append((r["config"], sp, S, float(r["max_reserved_mib"]) - whole, float(r["outside_allocator_mib"])))
if fixed:
    print()
    print("## The device's fixed costs (the planner's CUDA_FIXED_BYTES; the allocator's slack), per rank")
    print()
    print("Allocator reserve: max_memory_reserved - max_memory_allocated (block rounding, cached blocks). Outside the"
          " allocator: device memory the process holds beyond memory_reserved at the end (CUDA context, cuBLAS,"
          " NCCL), total - free - memory_reserved.")
    print()
    print("| config | sp | seq_len | allocator reserve MiB | outside the allocator MiB |")
    print("|---|---|---|---|---|")
    for name, sp, S, reserve, outside in fixed:
        print(f"| {name} | {sp} | {S} | {reserve:.0f} | {outside:.0f} |")
EOF
        } >> "$REPORT"
    else
        rc=1
        echo -e "\n## benchmarks/sweep.py failed: see benchmarks/results/gpu/sweep.log" >> "$REPORT"
    fi
fi
echo "Report: $REPORT"
exit "$rc"

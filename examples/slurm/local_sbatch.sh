#!/usr/bin/env bash
# Rehearse a SLURM batch script on ONE machine, without SLURM: a stand-in for `sbatch` + `srun` that sets the
# variables they set and starts nodes x ntasks-per-node local processes. For checking a job script before queueing
# it; it is not a scheduler (no GPUs are assigned, every "node" is this machine, the script runs in the foreground).
#
#   bash examples/slurm/local_sbatch.sh [--nodes=N] [--ntasks-per-node=G] SCRIPT [ARGS...]
#
# N and G default to the script's own #SBATCH lines, as with sbatch. The job gets SLURM_JOB_ID, SLURM_JOB_NAME,
# SLURM_NNODES, SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_JOB_NODELIST = SLURM_NODELIST = localhost and
# SLURM_SUBMIT_DIR; a fake `srun` first on PATH runs its command once per task with SLURM_PROCID (global rank),
# SLURM_LOCALID (rank in the node) and SLURM_NODEID (node), and stops every task as soon as one fails.
set -euo pipefail

nodes="" tasks=""
while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in
        --nodes=*) nodes="${1#*=}" ;;
        --ntasks-per-node=*) tasks="${1#*=}" ;;
        *) echo "local_sbatch.sh: unsupported option $1 (only --nodes=N and --ntasks-per-node=G)" >&2; exit 2 ;;
    esac
    shift
done
if [[ $# -lt 1 ]]; then
    echo "usage: local_sbatch.sh [--nodes=N] [--ntasks-per-node=G] SCRIPT [ARGS...]" >&2
    exit 2
fi
script="$1"
shift
directive() { sed -n "s/^#SBATCH --$1=\([0-9][0-9]*\).*/\1/p" "$script" | head -n 1; }
nodes="${nodes:-$(directive nodes)}"
tasks="${tasks:-$(directive ntasks-per-node)}"
nodes="${nodes:-1}" tasks="${tasks:-1}"

fake_bin="$(mktemp -d)"
trap 'rm -rf "$fake_bin"' EXIT
cat > "$fake_bin/srun" <<'SRUN'
#!/usr/bin/env bash
# Fake srun: one process per task, with the per-task variables the real srun sets.
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    for ((local = 0; local < SLURM_NTASKS_PER_NODE; local++)); do
        SLURM_PROCID=$((node * SLURM_NTASKS_PER_NODE + local)) SLURM_LOCALID=$local SLURM_NODEID=$node "$@" &
        pids+=($!)
    done
done
rc=0
for _ in "${pids[@]}"; do
    if ! wait -n; then
        rc=1
        kill "${pids[@]}" 2>/dev/null || true  # like srun --kill-on-bad-exit: the others would wait forever
    fi
done
exit "$rc"
SRUN
chmod +x "$fake_bin/srun"

export PATH="$fake_bin:$PATH"
export SLURM_JOB_ID="$((100000 + RANDOM))" SLURM_JOB_NAME="$(basename "$script")" SLURM_SUBMIT_DIR="$PWD"
export SLURM_NNODES="$nodes" SLURM_NTASKS_PER_NODE="$tasks" SLURM_NTASKS="$((nodes * tasks))"
export SLURM_JOB_NODELIST=localhost SLURM_NODELIST=localhost
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT
echo "[local_sbatch] job $SLURM_JOB_ID: $nodes nodes x $tasks tasks on this machine: $script $*" >&2
bash "$script" "$@"

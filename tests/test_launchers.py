"""The same training under the launchers Lightning users have: a SLURM job (srun's variables, 2 nodes × 2 tasks,
simulated on this machine) and torchrun. Lightning's own launcher (``Trainer(devices=N)`` re-running the script) is
exercised by ``tests/test_cli.py``.

The world must come from the cluster environment (not from torchrun-style variables), each SP group must sit inside
one node, an SP group that has to span nodes must train exactly and warn, and the training must match a single
device (``tests/test_parity.py``'s reference and tolerances).
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lightning_ulysses.parallel.layout import node_spanning_warning, sp_groups_span_nodes
from tests.support.launcher import REPO_ROOT, launch
from tests.test_parity import SEQ_LEN, STEPS, _run, check_against_reference

NODES, TASKS_PER_NODE = 2, 2
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
ON_TWO_NODES = {"devices": TASKS_PER_NODE, "num_nodes": NODES}
SLURM_RUNS = [
    # DP2×SP2: one SP group per node, data parallelism across the nodes.
    _run(2, 2, sp_size=2, batch_size=2, num_rows=4 * STEPS, trainer=ON_TWO_NODES),
    # SP4 over 2 nodes × 2 devices: the one SP group spans both nodes. Works, warns.
    _run(3, 4, sp_size=4, batch_size=2, num_rows=2 * STEPS, trainer=ON_TWO_NODES),
]
TORCHRUN_RUN = _run(3, 2, sp_size=2, batch_size=1, num_rows=STEPS, trainer={"devices": 2})


def slurm_env(nodes: int, tasks_per_node: int) -> tuple[dict[str, str], list[dict[str, str]]]:
    """What ``srun`` gives each task of ``sbatch --nodes=N --ntasks-per-node=G`` (job-wide, then per task)."""
    job = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ulysses-launch-test",  # not "bash"/"interactive", which Lightning treats as no SLURM
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "ULYSSES_TEST_UNSET_ENV": ",".join(TORCHRUN_VARS),  # no torchrun-style variables under srun
    }
    tasks = [{"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % tasks_per_node),
              "SLURM_NODEID": str(rank // tasks_per_node)} for rank in range(nodes * tasks_per_node)]
    return job, tasks


def clean_env() -> dict[str, str]:
    """The test process's environment minus anything that would make Lightning see another launcher."""
    drop = set(TORCHRUN_VARS) | {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return env


# ----------------------------------------------------------------------------------------------- pure check
@pytest.mark.parametrize("sp_size, devices_per_node, num_nodes, spans", [
    (2, 2, 2, False), (4, 2, 2, True), (8, 8, 4, False), (4, 8, 2, False), (16, 8, 2, True),
    (4, 6, 2, True),  # 4 does not divide 6: the group of ranks 4..7 crosses the boundary at 6
    (3, 6, 2, False), (4, 4, 1, False), (6, 6, 1, False), (1, 1, 8, False), (2, 1, 8, True),
])
def test_sp_groups_span_nodes_table(sp_size, devices_per_node, num_nodes, spans):
    assert sp_groups_span_nodes(sp_size, devices_per_node, num_nodes) is spans


def test_sp_groups_span_nodes_agrees_with_the_explicit_layout():
    """Against the definition: SP groups [k·sp, (k+1)·sp), global rank r on node r // devices_per_node."""
    checked = 0
    for nodes, devices, sp in itertools.product(range(1, 5), range(1, 9), range(1, 33)):
        world = nodes * devices
        if world % sp:
            continue
        explicit = any(len({r // devices for r in range(k * sp, (k + 1) * sp)}) > 1 for k in range(world // sp))
        assert sp_groups_span_nodes(sp, devices, nodes) is explicit, (sp, devices, nodes)
        checked += 1
    assert checked > 100


def test_node_spanning_warning_names_the_group_and_the_fix():
    message = node_spanning_warning(4, 2, 2)
    assert "Sequence-parallel groups span nodes" in message
    assert "`sp_size=4` does not divide the 2 devices per node (2 nodes)" in message
    assert "global ranks 0..3 has ranks on node 0 and node 1" in message
    assert "inter-node network" in message and "slower" in message
    assert "Choose `sp_size` from [1, 2]" in message
    assert "global ranks 4..7 has ranks on node 0 and node 1" in node_spanning_warning(4, 6, 2)
    assert "Choose `sp_size` from [1, 2, 3, 6]" in node_spanning_warning(4, 6, 2)
    # with ring attention the all-to-all group is the Ulysses part: the message names it
    assert "the Ulysses size `sp_size / ring_size = 4` does not divide" in node_spanning_warning(4, 2, 2, ring_size=2)
    with pytest.raises(ValueError, match="nothing to warn"):
        node_spanning_warning(2, 4, 2)


# ----------------------------------------------------------------------------------------------- SLURM
@pytest.fixture(scope="module")
def slurm_results():
    job, tasks = slurm_env(NODES, TASKS_PER_NODE)
    ranks = launch(NODES * TASKS_PER_NODE, "launchers:fit_runs", {"runs": SLURM_RUNS},
                   extra_env=job, per_rank_env=tasks)
    return [[rank["runs"][i] for rank in ranks] for i in range(len(SLURM_RUNS))]


def test_slurm_world_and_ranks_come_from_the_slurm_variables(slurm_results):
    for run in slurm_results:
        for rank, result in enumerate(run):
            env = result["environment"]
            assert env["cluster_environment"] == "SLURMEnvironment"
            assert env["creates_processes_externally"] is True
            assert (env["world_size"], env["num_nodes"], env["devices_per_node"]) == (4, NODES, TASKS_PER_NODE)
            assert (env["global_rank"], env["dist_rank"]) == (rank, rank)  # SLURM_PROCID
            assert env["local_rank"] == rank % TASKS_PER_NODE  # SLURM_LOCALID
            assert env["node_rank"] == rank // TASKS_PER_NODE  # SLURM_NODEID
            assert env["node_of_rank"] == [0, 0, 1, 1]


def test_slurm_sp_groups_stay_inside_a_node(slurm_results):
    envs = [r["environment"] for r in slurm_results[0]]
    assert [e["sp_group"] for e in envs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [(e["dp_rank"], e["sp_rank"]) for e in envs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for env in envs:
        assert len({env["node_of_rank"][r] for r in env["sp_group"]}) == 1  # one node per SP group
    assert {e["node_of_rank"][e["sp_group"][0]] for e in envs} == {0, 1}  # and one SP group per node
    for result in slurm_results[0]:
        assert not [w for w in result["warnings"] if "span nodes" in w]
        assert set(result["input_shapes"]) == {(2, SEQ_LEN // 2)}
        assert result["train_batch_size"] == 4  # micro-batch 2 × dp 2


def test_slurm_dp2_sp2_matches_single_device(slurm_results):
    check_against_reference(SLURM_RUNS[0], slurm_results[0], global_batch=2 * 2)


def test_sp_group_spanning_nodes_warns_once_and_still_trains_exactly(slurm_results):
    run = slurm_results[1]
    assert [r["environment"]["sp_group"] for r in run] == [[0, 1, 2, 3]] * 4
    spanning = [[w for w in r["warnings"] if "span nodes" in w] for r in run]
    assert spanning[0] == [node_spanning_warning(4, TASKS_PER_NODE, NODES)]  # rank 0 only, once
    assert spanning[1:] == [[], [], []]
    for result in run:
        assert set(result["input_shapes"]) == {(2, SEQ_LEN // 4)}
        assert result["attention_query_shapes"] == [(2, 4 // 4, SEQ_LEN, 16)]
    check_against_reference(SLURM_RUNS[1], run, global_batch=2)


# ----------------------------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def torchrun_results():
    with tempfile.TemporaryDirectory(prefix="ulysses-torchrun-") as tmp:
        payload = Path(tmp) / "payload.pkl"
        payload.write_bytes(pickle.dumps({"runs": [TORCHRUN_RUN]}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.scenarios.launchers", str(payload), tmp]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes())["runs"][0] for r in range(2)]


def test_torchrun_world_comes_from_torchelastic(torchrun_results):
    for rank, result in enumerate(torchrun_results):
        env = result["environment"]
        assert env["cluster_environment"] == "TorchElasticEnvironment"
        assert env["creates_processes_externally"] is True
        assert (env["world_size"], env["global_rank"], env["local_rank"], env["node_rank"]) == (2, rank, rank, 0)
        assert env["sp_group"] == [0, 1]
        assert set(result["input_shapes"]) == {(1, SEQ_LEN // 2)}


def test_torchrun_sp2_matches_single_device(torchrun_results):
    check_against_reference(TORCHRUN_RUN, torchrun_results, global_batch=1)

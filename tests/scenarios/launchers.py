"""Scenarios for the launcher tests (``tests/test_launchers.py``, ``tests/test_cli.py``).

* :func:`fit_runs`: parity fits with the world taken from whatever launched the process (SLURM variables, torchrun),
  returning what the parity checks need plus the cluster environment Lightning chose, the ranks it read, the node of
  every rank of the SP group, and the warnings of each fit. Run by ``tests/launcher.py``
  (``launch(N, "launchers:fit_runs", ...)``) or, under torchrun, as this module's ``__main__``:
  ``python -m torch.distributed.run --nproc_per_node=2 -m tests.scenarios.launchers PAYLOAD OUT_DIR`` (each rank writes
  ``OUT_DIR/rank<RANK>.pkl``).
* :class:`LaunchReport`: a callback the CLI tests add with ``--trainer.callbacks+=tests.scenarios.launchers.LaunchReport``;
  every rank writes what it ran with to ``out_dir/rank<global_rank>.json``.

``ULYSSES_TEST_UNSET_ENV`` (comma-separated names) is removed from the environment before Lightning is imported: the
simulated SLURM job must not carry the torchrun-style variables ``tests/launcher.py`` sets for every process.
"""

from __future__ import annotations

import os

for _name in filter(None, os.environ.pop("ULYSSES_TEST_UNSET_ENV", "").split(",")):
    os.environ.pop(_name, None)

import json  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from tests.support.training import fit_one  # noqa: E402


def _environment(trainer) -> dict[str, Any]:
    strategy = trainer.strategy
    env = strategy.cluster_environment
    node_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(node_ranks, strategy.node_rank)  # the node each global rank says it is on
    return {
        "cluster_environment": type(env).__name__,
        "creates_processes_externally": env.creates_processes_externally,
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": strategy.num_processes,
        "dist_rank": dist.get_rank(),
        "node_of_rank": node_ranks,
        "sp_group": strategy.layout.sp_group_ranks(),
        "sp_rank": strategy.sp_rank,
        "dp_rank": strategy.dp_rank,
        "dp_size": strategy.dp_size,
    }


def fit_runs(payload: dict) -> dict:
    """SGD fits, each a :class:`~tests.support.training.FitSpec` (``trainer``: devices, num_nodes);
    the parity scenario's record plus the launch environment and the warnings raised."""
    results = []
    for run in payload["runs"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result, trainer = fit_one(run)
        result.update(environment=_environment(trainer), warnings=[str(w.message) for w in caught])
        results.append(result)
    return {"runs": results}


class LaunchReport(Callback):
    """Writes, per rank, the strategy it trained with, the launch it saw and the steps it ran (JSON).

    Args:
        out_dir: Folder for ``rank<global_rank>.json``.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.input_shapes: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.input_shapes.append(list(batch["input_ids"].shape))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        zero = strategy.config["zero_optimization"]
        report = {
            "strategy_class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "sp_size": strategy.sp_size,
            "requested_sp_size": strategy.settings.sp_size,
            "stage": zero["stage"],
            "offload_optimizer": "offload_optimizer" in zero,
            "launcher": type(strategy.launcher).__name__ if strategy.launcher is not None else None,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "seq_len": trainer.datamodule.seq_len if trainer.datamodule is not None else None,
            "losses": self.losses,
            "input_shapes": self.input_shapes,
            "global_step": trainer.global_step,
            **{k: v for k, v in _environment(trainer).items()},
        }
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _torchrun_main() -> None:
    payload_path, out_dir = sys.argv[1:3]
    rank = os.environ["RANK"]  # set by torchrun; read before Lightning's teardown edits the environment
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    result = fit_runs(payload)
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _torchrun_main()

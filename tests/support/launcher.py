"""Launch N real processes (gloo on CPU, torchrun-style environment) that each run one scenario, and gather what
each returned. One launch runs many checks: importing torch + deepspeed + transformers costs seconds per process."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    num_procs: int,
    scenario: str,
    payload: Optional[dict] = None,
    timeout: float = 600,
    extra_env: Optional[dict[str, str]] = None,
    per_rank_env: Optional[list[dict[str, str]]] = None,
) -> list[Any]:
    """Run ``<scenario>(payload)`` on ``num_procs`` processes; return the results by rank.

    ``scenario`` is ``"<module>:<function>"`` of ``tests/scenarios/`` (see ``tests/support/worker.py``).

    Raises ``RuntimeError`` with each failed rank's output if any rank fails or the launch times out.
    """
    if os.environ.get("ULYSSES_TESTS_IN_PROCESS_ONLY"):
        raise RuntimeError(f"launch({num_procs}, {scenario!r}) from a test not marked `multiprocess` (tests/conftest.py"
                           " marks tests whose source or fixtures call launch(...)): mark it.")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ulysses-launch-") as tmp:
        payload_path = Path(tmp) / "payload.pkl"
        payload_path.write_bytes(pickle.dumps(payload or {}))
        procs, logs = [], []
        for rank in range(num_procs):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(num_procs),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(num_procs),
                "DS_ACCELERATOR": "cpu",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                **(extra_env or {}),
                **(per_rank_env[rank] if per_rank_env else {}),
            }
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            cmd = [sys.executable, "-m", "tests.support.worker", scenario, str(payload_path), str(Path(tmp) / f"rank{rank}.pkl")]
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                failed = True
                time.sleep(2)  # let the other ranks print their side of the failure
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        codes = [p.wait() for p in procs]
        if failed or any(codes):
            report = []
            for rank, log in enumerate(logs):
                log.seek(0)
                written = (Path(tmp) / f"rank{rank}.pkl").exists()
                report.append(f"--- rank {rank} (exit {codes[rank]}) --- result written: {written}\n"
                              f"{log.read()[-6000:]}")
            raise RuntimeError(f"scenario {scenario!r} failed on {num_procs} processes:\n" + "\n".join(report))
        for log in logs:
            log.close()
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(num_procs)]

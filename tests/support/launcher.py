"""Launch N real processes (gloo on CPU, torchrun-style environment) that each run one scenario, and gather what
each returned. One launch runs many checks: importing torch + deepspeed + transformers costs seconds per process.

The processes are forked from a fork server that has imported those libraries once (``tests/support/worker.py``,
``--serve``; started at the first launch, stopped when the tests end): each is still its own process, with its own
environment, gloo connections and exit status, started in half a second instead of seven. A launch whose
environment differs from the server's in anything but the ranks and the rendezvous (``extra_env``, a variable a test
set) starts fresh interpreters instead, as does every launch with ``ULYSSES_TESTS_FRESH_PROCESSES=1``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
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


# what a launch sets per process; any other difference from the fork server's environment starts fresh processes
_PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "PYTEST_CURRENT_TEST"}


class _ForkServer:
    """The running fork server: its process, its socket, and the environment it imported the libraries under."""

    def __init__(self, env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="ulysses-forks-")
        self.socket_path = str(Path(self.directory) / "server.sock")
        self.env = {k: v for k, v in env.items() if k not in _PER_LAUNCH}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.worker", "--serve", self.socket_path],
                                        cwd=REPO_ROOT, env=self.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        ready = self.process.stdout.readline() if self.process.stdout is not None else ""
        if ready.strip() != "ready":
            self.process.kill()
            raise RuntimeError("the fork server did not start")

    def serves(self, env: dict[str, str]) -> bool:
        return self.process.poll() is None and {k: v for k, v in env.items() if k not in _PER_LAUNCH} == self.env

    def ask(self, kind: str, body: Any) -> Any:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            conn.sendall(pickle.dumps((kind, body)))
            conn.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := conn.recv(1 << 16):
                chunks.append(chunk)
        return pickle.loads(b"".join(chunks)) if chunks else None

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask("stop", None)
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


_server: Optional[_ForkServer] = None


def _fork_server(env: dict[str, str]) -> Optional[_ForkServer]:
    """The fork server for a launch with ``env`` (the tests' own environment), started or restarted with it if
    needed; ``None`` where fresh processes must run."""
    global _server
    if os.environ.get("ULYSSES_TESTS_FRESH_PROCESSES") == "1" or sys.platform != "linux":
        return None
    if _server is not None and not _server.serves(env):
        _server.stop()
        _server = None
    if _server is None:
        _server = _ForkServer(env)
        atexit.register(_server.stop)
    return _server


class _Forked:
    """A worker forked by the server, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.ask("status", [self.pid]).get(self.pid)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


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
        procs, logs, specs = [], [], []
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
            argv = [scenario, str(payload_path), str(Path(tmp) / f"rank{rank}.pkl")]
            specs.append({"env": env, "argv": argv, "cwd": str(REPO_ROOT), "log": str(Path(tmp) / f"rank{rank}.log")})
        server = None if extra_env or per_rank_env else _fork_server(specs[0]["env"])
        if server is not None:
            procs = [_Forked(server, pid) for pid in server.ask("start", specs)]
            logs = [open(spec["log"], "a+") for spec in specs]
        else:
            for spec in specs:
                log = open(spec["log"], "w+")
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.worker", *spec["argv"]],
                                              cwd=REPO_ROOT, env=spec["env"], stdout=log, stderr=subprocess.STDOUT))
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
                for p in procs:
                    p.wait()
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

"""Entry point of one worker process: ``python -m tests.support.worker SCENARIO PAYLOAD_PATH RESULT_PATH``.

``SCENARIO`` is ``"<module>:<function>"``, the module one of ``tests/scenarios/`` (named after the test file that
uses it: ``tests/test_ring.py`` -> ``tests/scenarios/ring.py``, ``"ring:ring_alone"``; ``run`` is each module's main
scenario); its return value is pickled to ``RESULT_PATH`` for the launching test.

``python -m tests.support.worker --serve SOCKET`` is the launcher's fork server: it imports torch, Lightning,
DeepSpeed, transformers and the package once (about 7 s of a process's start on the 2-core machine) and forks one
worker process per rank of each launch, which then runs exactly as a fresh worker would (its own environment,
arguments, output file and exit status). Every worker is still a separate process with its own gloo connections.
"""

import gc
import importlib
import os
import pickle
import socket
import sys
import traceback


def resolve(name: str):
    """The scenario function ``"<module>:<function>"`` of ``tests/scenarios/``."""
    module_name, sep, function_name = name.partition(":")
    if not sep or "." in module_name:
        raise ValueError(f"scenario {name!r}: expected '<module of tests/scenarios>:<function>', e.g. 'parity:run'")
    return getattr(importlib.import_module(f"tests.scenarios.{module_name}"), function_name)


def main() -> None:
    name, payload_path, out_path = sys.argv[1:4]
    scenario = resolve(name)
    gc.freeze()  # the libraries the scenario imported: out of the collector's reach (see `serve`)
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    profile_dir = os.environ.get("ULYSSES_PROFILE_DIR")  # a developer's view of where a launch's time goes
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(scenario, payload)
        profiler.dump_stats(os.path.join(profile_dir, f"rank{os.environ.get('RANK', '0')}.prof"))
    else:
        result = scenario(payload)
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


def _leave(code: int) -> None:
    # The result is written; leave without interpreter teardown. Destructors of background threads (gloo, DeepSpeed)
    # at exit occasionally abort with "terminate called without an active exception" (seen once in 4-process runs,
    # after the scenario had finished), which would fail a test whose result is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------------ the fork server
PRELOADED = ("torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning.fabric", "deepspeed",
             "transformers", "lightning_ulysses", "lightning_ulysses.strategy", "lightning_ulysses.fabric")


def _receive(conn: socket.socket) -> object:
    chunks = []
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return pickle.loads(b"".join(chunks))
        chunks.append(chunk)


def _run_forked(spec: dict) -> None:
    """In the forked child: become the worker ``spec`` describes, run it, exit with its status."""
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    sys.argv = [os.path.abspath(__file__), *spec["argv"]]
    # Lightning reads the rank from the environment once, when it is imported (in the server, without one)
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero

    rank = int(spec["env"].get("RANK", 0))
    fabric_rank_zero.rank_zero_only.rank = rank
    pytorch_rank_zero.rank_zero_only.rank = rank
    try:
        main()
    except BaseException:  # noqa: BLE001 - the launcher reads the traceback from the log
        traceback.print_exc()
        _leave(1)
    _leave(0)


def serve(socket_path: str) -> None:
    """Answer the launcher's requests until it asks to stop (or goes away): ``("start", [spec, ...])`` forks a
    worker per spec and answers their pids; ``("status", [pid, ...])`` answers each one's exit status (``None``
    while it runs; ``-signal`` if a signal ended it)."""
    for name in PRELOADED:
        importlib.import_module(name)
    # The libraries' objects are never garbage: out of the collector's reach (inherited by every forked worker), so a
    # full collection walks only what a scenario makes. DeepSpeed's ZeRO 3 runs one at every engine set-up
    # (zero/utils.py `defragment`): 0.28 s each over the preloaded libraries, a fifth of a ZeRO 3-heavy launch.
    gc.collect()
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(8)
    print("ready", flush=True)
    exits: dict[int, int] = {}
    while True:
        conn, _ = server.accept()
        with conn:
            kind, body = _receive(conn)
            if kind == "stop":
                return
            if kind == "start":
                pids = []
                for spec in body:
                    pid = os.fork()
                    if pid == 0:
                        server.close()
                        conn.close()
                        _run_forked(spec)
                    pids.append(pid)
                answer: object = pids
            else:
                while True:  # reap every finished worker
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    exits[pid] = os.waitstatus_to_exitcode(status)
                answer = {pid: exits.get(pid) for pid in body}
            conn.sendall(pickle.dumps(answer))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
        sys.exit(0)
    main()
    _leave(0)

"""Entry point of one worker process: ``python -m tests.support.worker SCENARIO PAYLOAD_PATH RESULT_PATH``.

``SCENARIO`` is ``"<module>:<function>"``, the module one of ``tests/scenarios/`` (named after the test file that
uses it: ``tests/test_ring.py`` -> ``tests/scenarios/ring.py``, ``"ring:ring_alone"``; ``run`` is each module's main
scenario); its return value is pickled to ``RESULT_PATH`` for the launching test.
"""

import importlib
import os
import pickle
import sys


def resolve(name: str):
    """The scenario function ``"<module>:<function>"`` of ``tests/scenarios/``."""
    module_name, sep, function_name = name.partition(":")
    if not sep or "." in module_name:
        raise ValueError(f"scenario {name!r}: expected '<module of tests/scenarios>:<function>', e.g. 'parity:run'")
    return getattr(importlib.import_module(f"tests.scenarios.{module_name}"), function_name)


def main() -> None:
    name, payload_path, out_path = sys.argv[1:4]
    scenario = resolve(name)
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    result = scenario(payload)
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
    # The result is written; leave without interpreter teardown. Destructors of background threads (gloo, DeepSpeed)
    # at exit occasionally abort with "terminate called without an active exception" (seen once in 4-process runs,
    # after the scenario had finished), which would fail a test whose result is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Entry point of one worker process: ``python -m tests.worker SCENARIO PAYLOAD_PATH RESULT_PATH``.

``SCENARIO`` is a function of ``tests/scenarios.py`` or ``"package.module:function"``; its return value is pickled
to ``RESULT_PATH`` for the launching test.
"""

import importlib
import os
import pickle
import sys


def main() -> None:
    name, payload_path, out_path = sys.argv[1:4]
    module_name, _, function_name = name.rpartition(":") if ":" in name else ("tests.scenarios", ":", name)
    scenario = getattr(importlib.import_module(module_name), function_name)
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

"""Entry point of one worker process: ``python -m tests.worker SCENARIO PAYLOAD_PATH RESULT_PATH``.

``SCENARIO`` is a function of ``tests/scenarios.py`` or ``"package.module:function"``; its return value is pickled
to ``RESULT_PATH`` for the launching test.
"""

import importlib
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

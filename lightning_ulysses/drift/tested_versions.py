"""The versions of torch, Lightning, DeepSpeed and transformers the whole test suite passed on: requirements/lock.txt's.

Written by ``scripts/update_lock.sh`` together with the lock (``tests/test_drift.py`` checks that they agree).
"""

TESTED_VERSIONS = {
    "torch": "2.13.0",
    "lightning": "2.6.6",
    "deepspeed": "0.19.8",
    "transformers": "5.24.0",
}

"""The parity harness: several SGD fits of the tiny Llama, each returning its per-step losses and trained weights
for the test to compare with one device (``tests/test_parity.py`` and the files that reuse its runs)."""

from __future__ import annotations

from tests.support.training import fit_one


def run(payload: dict) -> dict:
    """Several SGD fits (see :func:`fit_one`)."""
    return {"runs": [fit_one(run)[0] for run in payload["runs"]]}

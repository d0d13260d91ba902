"""Several scenarios in one launch (importing torch + deepspeed + transformers costs seconds per process)."""

from __future__ import annotations

from tests.support.worker import resolve


def run(payload: dict) -> dict:
    """``{"name": ["<scenario module>:<function>", payload], ...}`` -> ``{"name": result, ...}``."""
    return {name: resolve(scenario)(sub_payload) for name, (scenario, sub_payload) in payload.items()}

"""Test-suite wiring: the ``multiprocess`` marker.

A test is ``multiprocess`` when it or one of its fixtures starts processes (``launch(...)`` of
``tests/support/launcher.py``, a ``subprocess`` such as torchrun or the CLI): those take seconds to minutes each.
``pytest -m "not multiprocess"`` runs the in-process tests alone, in seconds. The marker is set here from the
source of each test and its fixtures; a launch from a test left unmarked fails loudly under ``-m "not multiprocess"``
(the launcher refuses), so a missed case cannot go unnoticed.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

_STARTS_PROCESSES = re.compile(r"\blaunch\(|\bsubprocess\.|torch\.distributed\.run")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multiprocess: starts worker processes (gloo launches, torchrun, the CLI); deselect with"
                   " -m 'not multiprocess' for the in-process tests alone")
    if re.search(r"not\s+multiprocess", config.option.markexpr or ""):
        os.environ["ULYSSES_TESTS_IN_PROCESS_ONLY"] = "1"


def _starts_processes(function) -> bool:
    try:
        return bool(_STARTS_PROCESSES.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


def _unwrapped(function):
    """A fixture's own function (pytest wraps the functions decorated with ``@pytest.fixture``)."""
    getter = getattr(function, "_get_wrapped_function", None)
    return getter() if getter is not None else function


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        functions = [getattr(item, "function", None)]
        fixture_info = getattr(item, "_fixtureinfo", None)
        if fixture_info is not None:
            for definitions in fixture_info.name2fixturedefs.values():
                functions += [definition.func for definition in definitions]
        function = functions[0]
        if function is not None and "getfixturevalue" in inspect.getsource(function):
            # fixtures chosen at run time: any fixture of the module may be the one
            functions += [f for f in vars(item.module).values() if hasattr(f, "_get_wrapped_function")
                          or type(f).__name__ == "FixtureFunctionDefinition"]
        if any(f is not None and _starts_processes(_unwrapped(f)) for f in functions):
            item.add_marker(pytest.mark.multiprocess)

"""Test-suite wiring: the ``multiprocess`` marker.

A test is ``multiprocess`` when it or one of its fixtures starts processes (``launch(...)`` of
``tests/support/launcher.py``, a ``subprocess`` such as torchrun or the CLI), directly or through a function of its
module that does: those take seconds to minutes each.
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


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


_MODULE_STARTERS: dict[str, set[str]] = {}


def _process_starting_helpers(module) -> set[str]:
    """Names of the module's own functions that start processes, directly or through another such function."""
    if module.__name__ not in _MODULE_STARTERS:
        functions = {name: _source(f) for name, f in vars(module).items()
                     if inspect.isfunction(f) and f.__module__ == module.__name__}
        starters = {name for name, source in functions.items() if _STARTS_PROCESSES.search(source)}
        while True:
            more = {name for name, source in functions.items() if name not in starters
                    and any(re.search(rf"\b{re.escape(s)}\(", source) for s in starters)}
            if not more:
                break
            starters |= more
        _MODULE_STARTERS[module.__name__] = starters
    return _MODULE_STARTERS[module.__name__]


def _starts_processes(function, helpers: set[str]) -> bool:
    source = _source(function)
    return bool(_STARTS_PROCESSES.search(source)) or any(re.search(rf"\b{re.escape(h)}\(", source) for h in helpers)


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
        helpers = _process_starting_helpers(item.module)
        if any(f is not None and _starts_processes(_unwrapped(f), helpers) for f in functions):
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone (world size 1), for in-process tests of code that runs collectives;
    destroyed after the test."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", store=dist.FileStore(f"{directory}/store", 1), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The libraries the test modules imported are never garbage: out of the collector's reach, so that full
    collections (Python's own, and DeepSpeed's at every ZeRO 3 engine set-up) walk only what the tests make."""
    import gc

    gc.collect()
    gc.freeze()

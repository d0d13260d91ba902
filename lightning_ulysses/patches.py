"""Every change the strategy makes to objects it does not own, applied and undone in one way.

Two kinds:

* **process-global replacements** of a function of another library (``torch.nn.functional.scaled_dot_product_attention``
  during a prepared model's forward, functions of transformers' modeling modules, ``torch.nn.init`` under ZeRO-3,
  ``torch.load`` while a checkpoint is read): :func:`replaced` is the one context manager that swaps an attribute
  and puts the original back, also on an exception;
* **preparations of the user's objects** for a Trainer stage (a model switched to Ulysses attention, an attention core
  wrapped, a DataLoader's collate function): the strategy enters each into its :class:`PatchStack` when it makes
  it, and closing the stack in ``teardown`` (which Lightning also calls after an exception) undoes all of them, last
  first.

Both are listed by :func:`active_patches` while they are in effect, so a test can check that none outlives a fit.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Iterator, TypeVar

_active: list[str] = []  # names of the patches in effect in this process, in the order they were applied
_MISSING = object()
T = TypeVar("T")


def active_patches() -> list[str]:
    """The patches in effect now (``"<owner>.<attribute>"`` for replacements, the stack entries' names otherwise)."""
    return list(_active)


@contextmanager
def replaced(owner: Any, attribute: str, replacement: Any, name: str = "") -> Iterator[Any]:
    """``owner.<attribute>`` is ``replacement`` inside the block and what it was before after it (also after an
    exception). Yields the original."""
    original = getattr(owner, attribute, _MISSING)
    label = name or f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}"
    setattr(owner, attribute, replacement)
    _active.append(label)
    try:
        yield None if original is _MISSING else original
    finally:
        if original is _MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)
        _active.remove(label)


@contextmanager
def tracked(name: str) -> Iterator[None]:
    """Marks a change made by the caller as in effect inside the block (for :func:`active_patches`)."""
    _active.append(name)
    try:
        yield
    finally:
        _active.remove(name)


class PatchStack:
    """The strategy's changes to the user's objects for one Trainer stage, undone together by :meth:`close`."""

    def __init__(self) -> None:
        self._stack = ExitStack()

    def enter(self, name: str, patch: ContextManager[T]) -> T:
        """Apply ``patch`` (a context manager) now; it is exited by :meth:`close`."""
        value = self._stack.enter_context(patch)
        self._stack.enter_context(tracked(name))
        return value

    def apply(self, name: str, apply: Callable[[], Any], undo: Callable[[], Any]) -> None:
        """Call ``apply()`` now and ``undo()`` at :meth:`close`."""
        apply()
        self._stack.callback(undo)
        self._stack.enter_context(tracked(name))

    def close(self) -> None:
        """Undo every change, last applied first."""
        self._stack.close()


# ------------------------------------------------------------------------------------------ instance attributes
# The one way the package writes into another object's instance dictionary: what it puts on a user's module (a
# replaced ``forward``, the step context an attention reads, what it must give back in teardown) shadows the class's
# attribute without ``nn.Module.__setattr__`` registering it as a submodule or parameter. The prepare/restore pairs that
# call these run as one :class:`PatchStack` entry each.
def put_on_instance(obj: Any, name: str, value: Any) -> None:
    """``obj.<name>`` is ``value`` from the instance's own dictionary (shadowing the class's ``name``)."""
    vars(obj)[name] = value


def take_from_instance(obj: Any, name: str, default: Any = None) -> Any:
    """Remove ``name`` from ``obj``'s own dictionary (the class's attribute shows again); returns what it held."""
    return vars(obj).pop(name, default)


def on_instance(obj: Any, name: str, default: Any = None) -> Any:
    """What ``obj``'s own dictionary holds under ``name`` (not the class's attribute)."""
    return vars(obj).get(name, default)


def held_on_instance(obj: Any, name: str) -> bool:
    """Whether ``obj``'s own dictionary holds ``name``."""
    return name in vars(obj)

"""The attention's inputs that the calling model code never reads again, given back to the allocator (Ulysses-Offload).

A Hugging Face attention module keeps its rotated queries, keys and values as local variables until it returns:

    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, ...)
    attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())   # q, k, v still held here
    return attn_output, attn_weights

With ``offload_attention`` the strategy's attention has copied what it needs of them into its chunk store, so those
locals hold 1.5 ``[s, H]`` (Llama-3.1-8B's GQA shape) of dead bytes at what was the layer's largest moment (the output
projection). Other models read them after the call (Diff-Llama calls the attention twice with the same queries and
reads them after; a helper may get them from its own caller): whether the caller does is read from the caller's own
bytecode, not assumed. A released view's base (the projection output that ``value_states`` reshapes, a fused q/k/v
projection) is released too once no other tensor views it and it passes the same checks. The bytecode reading is
checked once per process on probes with known answers (:func:`reading_verified`): where it errs, nothing is released.

:func:`release_unread_arguments` frees an argument tensor's bytes only when all of these hold:

- nothing will need its values for a backward pass: no graph is being recorded (a layer checkpoint's first forward,
  evaluation), or it is inside :func:`saved_tensors_leave_the_device` and its storage is large enough that what
  autograd saves of it is a copy (a layer checkpoint's recompute on CUDA: a megabyte or more goes to host memory;
  autograd holding the tensor itself would read the NaN below in backward, silently);
- every local variable of the calling function that holds it (or holds a tuple, list or dict holding it) is dead
  after the call in progress: on no path from the call (exception handlers included) is it read before being
  assigned again; a variable that a closure captures, or code that can read its frame's variables by name
  (``locals()``, ``vars()``, ``eval``, ``exec``, frame access), counts as read; none of them is a parameter of the
  calling function (what was passed in, its own caller holds too);
- no cache object (``transformers``' ``Cache``) is among the caller's variables, and the calling module does not keep
  it as an attribute: nothing else in Python that is known to store it.

Freeing swaps the tensor's storage for a one-element NaN storage with zero strides (``set_``): its shape stays, its
bytes go back to the allocator once no other tensor views them, and a read that the analysis missed gives NaN (which
the loss guard stops on), not a crash or another tensor's bytes; a write into it fails.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import inspect
import sys
import types
from typing import Any, Iterator, Optional, Sequence

import torch

from lightning_ulysses import _compat

# names whose use lets code read its own frame's variables by name: any of them in a function disables the analysis
_FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe", "getframeinfo",
                            "f_locals", "f_back"})
_NO_FALLTHROUGH = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD",
                             "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE", "JUMP",
                             "JUMP_NO_INTERRUPT"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))

_HOST_SAVING: list[int] = []  # per layer recompute in progress whose saved tensors leave the device: from what size
RELEASED = [0]  # tensors released in this process so far (what tests and benchmarks count)


@contextlib.contextmanager
def saved_tensors_leave_the_device(min_bytes: Optional[int]) -> Iterator[None]:
    """While in it, what autograd saves of a storage of ``min_bytes`` or more is a copy (in host memory, or a small
    view's clone: the strategy's layer checkpoint's recompute,
    :func:`lightning_ulysses.offload.layer_checkpoint.host_saved_tensors`), never the device tensor itself; ``None``:
    not so (nothing moves, as on a CPU)."""
    if min_bytes is None:
        yield
        return
    _HOST_SAVING.append(min_bytes)
    try:
        yield
    finally:
        _HOST_SAVING.pop()


def release_unread_arguments(caller: Optional[types.FrameType], tensors: Sequence[torch.Tensor],
                             module: Any = None) -> int:
    """Free the bytes of each of ``tensors`` (arguments of the call in progress in ``caller``, the calling model
    code's frame) that nothing reads again (the module docstring's conditions); ``module``: the calling module (its
    attributes must not hold them). A view's bytes are its base's: the base (a projection's output that the view
    reshapes, or a fused q/k/v projection's) is released too once no other tensor views it and it passes the same
    conditions. Returns how many tensors were released."""
    recording = torch.is_grad_enabled()
    if caller is None or (recording and not _HOST_SAVING) or not reading_verified():
        return 0
    variables = _caller_variables(caller)
    if variables is None:
        return 0
    module_values = list(vars(module).values()) if module is not None and hasattr(module, "__dict__") else []

    parameters = _parameter_names(caller.f_code)
    candidates: list[torch.Tensor] = []  # what a variable holds is recognised by a mark set here, not by identity
    for tensor in tensors:
        if getattr(tensor, _MARK, None) is None:
            setattr(tensor, _MARK, len(candidates))
            candidates.append(tensor)
    arguments = len(candidates)
    for tensor in candidates[:arguments]:  # a view's bytes are its base's
        base = tensor._base
        if base is not None and getattr(base, _MARK, None) is None:
            setattr(base, _MARK, len(candidates))
            candidates.append(base)
    try:
        bases = candidates[arguments:]
        released = [tensor for tensor in candidates[:arguments]
                    if _unread(tensor, variables, parameters, caller, module_values, recording)]
        for tensor in released:
            _swap_for_poison(tensor)
        for base in bases:  # once its views here are released: no other tensor may still view its bytes
            if _compat.storage_use_count(base) == _compat.LONE_STORAGE_USE_COUNT and \
                    _unread(base, variables, parameters, caller, module_values, recording):
                _swap_for_poison(base)
                released.append(base)
    finally:
        for tensor in candidates:
            delattr(tensor, _MARK)
    RELEASED[0] += len(released)
    return len(released)


_MARK = "_ulysses_release_candidate"  # set on the candidates while the caller's variables are searched


def _unread(tensor: torch.Tensor, variables: dict[str, Any], parameters: set[str], caller: types.FrameType,
            module_values: list[Any], recording: bool) -> bool:
    mark = getattr(tensor, _MARK)
    # the variables holding it, or a tuple, list or dict holding it
    names = {name for name, value in variables.items() if _marked(value, mark) or _holds(value, mark)}
    if names & parameters:
        return False  # passed in: the calling function's own caller holds it too, and is not read here
    if names and not names <= dead_after_current_call(caller, names):
        return False
    if any(_marked(value, mark) for value in module_values):
        return False
    # in a recompute, autograd may hold a small tensor itself for backward (small ones stay on the device)
    return not recording or tensor.untyped_storage().nbytes() >= _HOST_SAVING[-1]


def _marked(value: Any, mark: int) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _MARK, None) == mark


def _caller_variables(caller: types.FrameType) -> Optional[dict[str, Any]]:
    """The caller's variables by name; ``None`` when a cache (``transformers``' ``Cache``) is among them."""
    from transformers.cache_utils import Cache

    snapshot = caller.f_locals  # Python < 3.13: a dict kept on the frame, holding what it holds now; 3.13+: a proxy
    variables = dict(snapshot)
    if isinstance(snapshot, dict):
        snapshot.clear()  # so that it keeps no value the function later replaces (refilled from the frame when read)
    if any(isinstance(value, Cache) for value in variables.values()):
        return None
    return variables


def _parameter_names(code: types.CodeType) -> set[str]:
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return set(code.co_varnames[:count])


def _holds(value: Any, mark: int) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_marked(item, mark) for item in value)
    if isinstance(value, dict):
        return any(_marked(item, mark) for item in value.values())
    return False


def _swap_for_poison(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        poison = torch.full((1,), float("nan"), dtype=tensor.dtype, device=tensor.device)
        tensor.set_(poison.untyped_storage(), 0, tensor.shape, (0,) * tensor.dim())  # [*shape], zero strides


# ---------------------------------------------------------------------------------------------- bytecode liveness
def dead_after_current_call(frame: types.FrameType, names: set[str]) -> set[str]:
    """The ``names`` among ``frame``'s local variables that no path from its call in progress reads before assigning
    them again (exception handlers count as paths; a captured variable, or code that reads its frame by name, counts
    as read). Empty where ``frame`` is not at a call or its bytecode is not understood."""
    code = frame.f_code
    if set(code.co_names) & _FRAME_READERS or "locals" in code.co_varnames:
        return set()
    names = set(names) - set(code.co_cellvars) - set(code.co_freevars)
    flow = _flow(code)
    if flow is None or not names:
        return set()
    instructions, offsets, successors = flow
    at = bisect.bisect_right(offsets, frame.f_lasti) - 1  # f_lasti may point into the call's inline caches
    if at < 0 or not instructions[at].opname.startswith("CALL"):
        return set()
    return {name for name in names if not _read_later(instructions, successors, at, name)}


def _read_later(instructions: list[dis.Instruction], successors: list[list[int]], start: int, name: str) -> bool:
    seen: set[int] = set()
    pending = list(successors[start])
    while pending:
        index = pending.pop()
        if index in seen:
            continue
        seen.add(index)
        effect = _effect(instructions[index], name)
        if effect == "read":
            return True
        if effect != "assign":
            pending.extend(successors[index])
    return False


def _effect(instruction: dis.Instruction, name: str) -> Optional[str]:
    """What ``instruction`` does to local variable ``name``: ``"read"``, ``"assign"`` (or delete), or ``None``."""
    opname, value = instruction.opname, instruction.argval
    if not any(part in opname for part in ("FAST", "DEREF", "CLOSURE", "CELL", "NAME")):
        return None
    mentioned = value if isinstance(value, tuple) else (value,)
    if name not in mentioned:
        return None
    if opname in ("STORE_FAST", "DELETE_FAST", "STORE_FAST_STORE_FAST"):
        return "assign"
    if opname == "STORE_FAST_LOAD_FAST" and mentioned[0] == name and mentioned[-1] != name:
        return "assign"
    return "read"  # every other instruction naming it (loads, cells, anything newer) counts as a read


@functools.lru_cache(maxsize=512)
def _flow(code: types.CodeType) -> Optional[tuple[list[dis.Instruction], list[int], list[list[int]]]]:
    """``code``'s instructions, their offsets and each one's successors (fall-through, jump target, the exception
    handler of the range it is in)."""
    try:
        bytecode = dis.Bytecode(code)
        instructions = list(bytecode)
        entries = list(bytecode.exception_entries)
    except (AttributeError, TypeError, ValueError):
        return None
    offsets = [instruction.offset for instruction in instructions]
    index_of = {offset: index for index, offset in enumerate(offsets)}
    successors: list[list[int]] = []
    for index, instruction in enumerate(instructions):
        following = []
        if instruction.opname not in _NO_FALLTHROUGH and index + 1 < len(instructions):
            following.append(index + 1)
        jump_target = getattr(instruction, "jump_target", None)  # Python 3.13+ names it
        if instruction.opcode in _JUMPS or jump_target is not None:
            target = index_of.get(jump_target if jump_target is not None else instruction.argval)
            if target is None:
                return None  # a jump this reading does not resolve: no claim about this code
            following.append(target)
        for entry in entries:
            if entry.start <= instruction.offset < entry.end:
                handler = index_of.get(entry.target)
                if handler is None:
                    return None
                following.append(handler)
        successors.append(following)
    return instructions, offsets, successors



# ------------------------------------------------------------------------------------------- the reading, checked
# This reading of CPython's bytecode is tested on the Python the project pins (3.11). On another version a new opcode
# or control-flow form could hide a read; so before the first release the reading answers probes whose answers are
# known (a read after the call, in the next loop iteration, in a finally block, an assignment first, a closure, a
# read on one branch only), and any wrong answer turns the release off for the process.
def _probe_point(names: set[str], found: dict) -> None:
    found["dead"] = dead_after_current_call(sys._getframe(1), names)


def _probe_after(found: dict) -> int:
    a, b, c = 1, 2, 3
    _probe_point({"a", "b", "c"}, found)
    del a  # (an unbinding, not a read)
    if b:
        return c
    return 0


def _probe_loop(found: dict) -> int:
    total, a, b = 0, 1, 2
    for _ in range(2):
        _probe_point({"a", "b"}, found)
        total += a
    del b
    return total


def _probe_finally(found: dict) -> int:
    a, b = 1, 2
    try:
        _probe_point({"a", "b"}, found)
    finally:
        a += 1
    del b
    return a


def _probe_assigned(found: dict) -> int:
    a, b = 1, 2
    _probe_point({"a", "b"}, found)
    a = 5
    return a + b


def _probe_closure(found: dict) -> int:
    a, b = 1, 2
    later = lambda: a  # noqa: E731
    _probe_point({"a", "b"}, found)
    del b
    return later()


def _probe_comprehension(found: dict) -> list:
    a, b, x = 1, 2, 3
    _probe_point({"a", "b", "x"}, found)
    values = [x for x in range(b)]  # the comprehension's own x (inlined on 3.12+) does not read this x
    del a, x
    return values


# (probe, the variables truly dead at its call, those the reading must find): it may miss one (3.12+ inlines the
# comprehension, whose LOAD_FAST_AND_CLEAR counts as a read), never call a live one dead
_PROBES = ((_probe_after, {"a"}, {"a"}), (_probe_loop, {"b"}, {"b"}), (_probe_finally, {"b"}, {"b"}),
           (_probe_assigned, {"a"}, {"a"}), (_probe_closure, {"b"}, {"b"}), (_probe_comprehension, {"a", "x"}, {"a"}))


@functools.lru_cache(maxsize=1)
def reading_verified() -> bool:
    """Whether this Python's bytecode is read right on the probes above (once per process): no live variable called
    dead, the plain cases found."""
    for probe, truly_dead, must_find in _PROBES:
        found: dict = {}
        probe(found)
        dead = found.get("dead", set())
        if not must_find <= dead <= truly_dead:
            return False
    return True

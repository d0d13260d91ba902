"""offload/unread_arguments.py: which of the caller's variables its bytecode never reads again after the call in
progress, and the release of the attention's inputs that only those variables hold. In process; the release inside
launched training (every layer's q, k, v given back, losses and updates those of one device) is asserted in
tests/test_offload_attention.py (`..._and_the_alst_switches_...`), the memory it frees in the planner's trace in
tests/offload/test_layer_checkpoint.py."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import DynamicCache

from lightning_ulysses.offload import unread_arguments
from lightning_ulysses.offload.unread_arguments import release_unread_arguments


def _attention(q, k, v, seen=None, keep=None):
    """Stands for the strategy's attention: answers from its inputs, then releases what the caller never reads
    (``keep``: where this test looks at them afterwards)."""
    out = q + k + v.transpose(0, 1).reshape(q.shape)
    released = release_unread_arguments(sys._getframe(1), (q, k, v))
    if seen is not None:
        seen.append(released)
    if keep is not None:
        keep.extend((q, k, v))
    return out


def _hf_like(x, seen):
    query_states, key_states = x * 2, x * 3
    value_states = (x * 4).view(4, 8, 128).transpose(0, 1)  # a view of the projection's output, as HF's values
    attn_output = _attention(query_states, key_states, value_states, seen)
    attn_output = attn_output * 1.5
    return attn_output


def _reads_query_after(x, seen):
    query_states, key_states, value_states = x * 2, x * 3, x * 4
    attn_output = _attention(query_states, key_states, value_states, seen)
    return attn_output - query_states  # as Diff-Llama-style code reads its inputs again


def _reads_in_the_next_iteration(x, seen):
    out = torch.zeros_like(x)
    query_states = x * 2
    for _ in range(2):
        out = out + _attention(query_states, x * 3, x * 4, seen)  # the loop reads q again
    return out


def _reads_in_a_handler(x, seen):
    query_states = x * 2
    try:
        out = _attention(query_states, x * 3, x * 4, seen)
    finally:
        query_states.sum()  # a finally block runs after the call
    return out


def _assigns_before_reading(x, seen):
    query_states = x * 2
    out = _attention(query_states, x * 3, x * 4, seen)
    query_states = out * 2  # a new value: the old one is dead
    return out + query_states


def _another_view_stays(x, seen):
    projected = x * 4
    value_states = projected.view(4, 8, 128).transpose(0, 1)
    rows = projected[:2]  # another view of the same bytes, read after the call
    out = _attention(x * 2, x * 3, value_states, seen)
    return out + rows.sum()  # v is dead, its base is not: another view of it is read


def _captured_by_a_closure(x, seen):
    query_states = x * 2
    later = lambda: query_states.sum()  # noqa: E731 - a closure may read it at any time
    out = _attention(query_states, x * 3, x * 4, seen)
    return out + later()


def _keeps_a_cache(x, seen):
    cache = DynamicCache()  # a cache in the caller may hold its inputs
    query_states = x * 2
    out = _attention(query_states, x * 3, x * 4, seen)
    del cache
    return out


@pytest.mark.parametrize("function,released", [
    (_hf_like, 4),  # q, k, v and the output v views
    (_reads_query_after, 2),  # k and v only
    (_reads_in_the_next_iteration, 4),  # the temporaries x * 3 and x * 4 of both calls (no variable holds them)
    (_reads_in_a_handler, 2),
    (_assigns_before_reading, 3),
    (_another_view_stays, 3),  # q, k, v, not the output v views (a live view of it stays)
    (_captured_by_a_closure, 2),
    (_keeps_a_cache, 0),
])
def test_only_what_the_caller_never_reads_again_is_released(function, released):
    x = torch.randn(4, 1024)
    reference = function(x.clone(), None)  # a graph may be recorded (grad mode): nothing is released
    seen: list[int] = []
    with torch.no_grad():
        got = function(x.clone(), seen)
    assert sum(seen) == released, seen
    torch.testing.assert_close(got, reference, rtol=0, atol=0)  # nothing read a released tensor


def test_a_released_tensor_keeps_its_shape_gives_its_bytes_back_and_reads_nan():
    x = torch.randn(256, 1024)
    kept: list[torch.Tensor] = []

    def caller():
        query_states = x * 2
        old.append(query_states.untyped_storage())
        return _attention(query_states, x * 3, x * 4, keep=kept)  # query_states is dead after the call

    old: list = []
    before = unread_arguments.RELEASED[0]
    with torch.no_grad():
        caller()
    q = kept[0]
    assert unread_arguments.RELEASED[0] - before == 3
    assert q.shape == (256, 1024) and q.untyped_storage().nbytes() == q.element_size()  # one NaN element
    assert old[0].nbytes() == 256 * 1024 * 4  # the old storage lives on only through this test's name for it
    assert torch.isnan(q).all()
    with pytest.raises(RuntimeError):
        q.add_(1.0)  # zero strides: a write fails


def _helper(query_states, key_states, seen):  # receives q and k: its own caller holds them too
    return _attention(query_states, key_states, key_states * 2, seen)


def _passes_to_a_helper(x, seen):
    query_states, key_states = x * 2, x * 3
    out = _helper(query_states, key_states, seen)
    return out + query_states  # read here, in the helper's caller


def _takes_from_a_container(pair, seen):
    query_states = pair[0]  # the caller's caller holds the pair
    return _attention(query_states, pair[1], pair[1] * 2, seen)


def test_what_the_calling_function_was_given_is_kept():
    x = torch.randn(4, 1024)
    reference = _passes_to_a_helper(x, None)
    seen: list[int] = []
    with torch.no_grad():
        got = _passes_to_a_helper(x, seen)
        pair = (x * 2, x * 3)
        _takes_from_a_container(pair, seen)
    assert seen == [1, 1], seen  # only the temporaries made in the call (key_states * 2)
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    assert not torch.isnan(pair[0]).any() and not torch.isnan(pair[1]).any()


def test_nothing_is_released_while_a_graph_is_recorded_unless_saved_tensors_leave_the_device():
    x = torch.randn(4, 1024, requires_grad=True)
    seen: list[int] = []
    out = _hf_like(x, seen)  # autograd may hold them: kept
    out.sum().backward()
    assert seen == [0]
    seen.clear()
    with unread_arguments.saved_tensors_leave_the_device(4 * 1024 * 4):
        _hf_like(x.detach(), seen)  # storages of 16 KiB: what autograd saves of them is a copy
    assert seen == [4]  # q, k, v and its base
    seen.clear()
    with unread_arguments.saved_tensors_leave_the_device(4 * 1024 * 4 + 1):
        _hf_like(x.detach(), seen)  # smaller than what moves: autograd may hold them themselves
    assert seen == [0]
    seen.clear()
    with unread_arguments.saved_tensors_leave_the_device(None):  # nothing moves (a CPU)
        _hf_like(x.detach(), seen)
    assert seen == [0]


def test_a_saved_tensor_poisoned_fails_loudly_without_hooks():
    """Why the size condition: without saved-tensor hooks autograd's version check stops a backward that would read
    a released tensor; through hooks that keep the tensor itself it would read NaN silently."""
    weight = torch.randn(8, requires_grad=True)
    q = torch.randn(4, 8, requires_grad=True) * 2
    y = (q * weight).sum()  # saves q for the weight's gradient
    unread_arguments._swap_for_poison(q)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_an_attribute_of_the_calling_module_holding_it_keeps_it():
    class Keeper(torch.nn.Module):
        def forward(self, x):
            query_states = x * 2
            self.last_query = query_states
            out = query_states + 1
            n = release_unread_arguments(sys._getframe(0), (query_states,), self)  # as if inside the call
            return out, n

    with torch.no_grad():
        _, released = Keeper()(torch.randn(4, 1024))
    assert released == 0


@pytest.mark.parametrize("probe,truly_dead,must_find", unread_arguments._PROBES,
                         ids=[probe.__name__ for probe, _, _ in unread_arguments._PROBES])
def test_the_reading_of_each_probe(probe, truly_dead, must_find):
    """A read after the call, in the next loop iteration, in a finally block, an assignment first, a closure, a
    comprehension's own variable: this Python's answers (3.11: exact)."""
    found: dict = {}
    probe(found)
    assert must_find <= found["dead"] <= truly_dead, found
    if sys.version_info[:2] == (3, 11):
        assert found["dead"] == truly_dead


def test_a_reading_that_misses_reads_fails_its_probes_and_releases_nothing(monkeypatch):
    """On another Python a new opcode could hide a read: the probes with known answers catch a reading that calls a
    live variable dead, and then nothing is released."""
    assert unread_arguments.reading_verified()
    monkeypatch.setattr(unread_arguments, "_effect", lambda instruction, name: None)  # sees no read at all
    unread_arguments._flow.cache_clear()
    unread_arguments.reading_verified.cache_clear()
    try:
        assert not unread_arguments.reading_verified()
        seen: list[int] = []
        with torch.no_grad():
            _reads_query_after(torch.randn(4, 1024), seen)
        assert seen == [0]
    finally:
        unread_arguments.reading_verified.cache_clear()

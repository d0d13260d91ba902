"""Ulysses-Offload's layer checkpoint and rotary tiles (offload/layer_checkpoint.py, offload/rotary_tiles.py), in
process on CPU: the same loss and gradients as the model without them, what each keeps, and the memory the planner's
trace (the CUDA behaviour, shapes only) gives them. The launched exactness against one device at ZeRO 2/3 and packed
rows: tests/test_offload_attention.py (`..._and_the_alst_switches_...`); the CUDA path: tests/test_cuda.py."""

from __future__ import annotations

import ctypes
import functools

import numpy
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from lightning_ulysses import _compat
from lightning_ulysses.models import memory
from lightning_ulysses.offload import layer_checkpoint, rotary_tiles
from lightning_ulysses.parallel import offload_attention
from lightning_ulysses.plan import activations

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128)


def _nodes(tensor: torch.Tensor) -> set[str]:
    seen, pending, names = set(), [tensor.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


def _train_step(model_type: str, features: memory.MemoryFeatures | None, **sizes) -> tuple[float, list, set]:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **sizes}, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    model.train()  # dropout on where the config has it
    if features is not None:
        memory.enable(model, features, None)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the same dropout masks for both runs
    loss = model(input_ids=ids, labels=ids).loss
    nodes = _nodes(loss)
    loss.backward()
    if features is not None:
        memory.disable(model)
    return float(loss), [p.grad.clone() for p in model.parameters()], nodes


@pytest.mark.parametrize("model_type,sizes", [("llama", {}), ("gpt2", {"resid_pdrop": 0.3, "embd_pdrop": 0.1}),
                                              ("qwen3_next", {"head_dim": 16, "linear_num_key_heads": 2,
                                                              "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                                              "linear_value_head_dim": 16, "num_experts": 4,
                                                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                              "shared_expert_intermediate_size": 32})])
def test_the_layer_checkpoint_gives_the_models_loss_and_gradients(model_type, sizes):
    """Every decoder layer runs through the strategy's checkpoint (its backward node in the graph), the first forward
    without a graph, the second in backward with the random generators replayed (GPT-2's dropout: the masks of the
    loss, not new ones) and the rotary embedding in tiles; fp32, against the same switches with torch's checkpoint
    (the tiled MLP draws its dropout masks tile by tile): 1e-6."""
    plain_loss, plain_grads, plain_nodes = _train_step(
        model_type, memory.MemoryFeatures(tiled_mlp=3, offload_checkpoints=True), **sizes)
    assert "_RecomputedLayerBackward" not in plain_nodes
    rotary_tiles.TILE_BYTES, tile_bytes = 3 * 64 * 4, rotary_tiles.TILE_BYTES  # 3 positions a tile: 40 cut unevenly
    try:
        features = memory.MemoryFeatures(tiled_mlp=3, offload_checkpoints=True, ulysses_offload=True)
        loss, grads, nodes = _train_step(model_type, features, **sizes)
    finally:
        rotary_tiles.TILE_BYTES = tile_bytes
    assert "_RecomputedLayerBackward" in nodes, nodes
    assert abs(loss - plain_loss) <= 1e-6
    worst = max(float((g - p).abs().max() / p.abs().max().clamp_min(1e-12)) for g, p in zip(grads, plain_grads))
    assert worst <= 1e-6, worst


class _EmulatedHost:
    """The chunk store as on CUDA, on a CPU: a stored tensor's bytes leave torch (a NumPy copy) and come back as a
    new tensor (benchmarks/host_emulation.py's rule), so that the CUDA-only paths run here."""

    offloads = True
    puts: list = []

    def __init__(self, device):
        pass

    def put(self, tensor):
        self.puts.append(tuple(tensor.shape))
        # the bytes copied straight from memory: .numpy() would mark the storage as not resizable (some are freed)
        tensor = tensor.detach().contiguous()
        host = numpy.empty(tensor.numel() * tensor.element_size(), dtype=numpy.uint8)
        ctypes.memmove(host.ctypes.data, tensor.data_ptr(), host.nbytes)
        return tensor.dtype, tensor.shape, host

    def fetch(self, handle):
        dtype, shape, host = handle
        return torch.from_numpy(host).view(dtype).view(shape).clone()

    def ready(self, fetched):
        return fetched

    def release(self, handle):
        pass


def test_the_cuda_paths_of_the_layer_checkpoint_emulated_on_a_host(monkeypatch):
    """With a store that moves to a host (emulated on CPU as on CUDA): the recompute's saved tensors go there and
    come back, the incoming gradient waits there while the layer runs again, the recomputed input's and output's
    storages are freed (``resize_(0)``); the loss and gradients stay those of torch's checkpoint (1e-6)."""
    reference_loss, reference, _ = _train_step("llama", memory.MemoryFeatures(tiled_mlp=3, offload_checkpoints=True))
    released = []
    monkeypatch.setattr(_compat, "STORAGE_RELEASED", [*_compat.STORAGE_RELEASED,
                                                      lambda key, nbytes: released.append(nbytes)])
    monkeypatch.setattr(offload_attention, "ChunkStore", _EmulatedHost)
    monkeypatch.setattr(layer_checkpoint, "HOST_MIN_BYTES", 1024)
    host = _EmulatedHost(None)  # the checkpoints too, as offload_checkpoints moves them on an accelerator
    monkeypatch.setattr(memory, "_offload_to_host", lambda: torch.autograd.graph.saved_tensors_hooks(host.put,
                                                                                                      host.fetch))
    _EmulatedHost.puts = []
    features = memory.MemoryFeatures(tiled_mlp=3, offload_checkpoints=True, ulysses_offload=True)
    loss, grads, nodes = _train_step("llama", features)
    assert "_RecomputedLayerBackward" in nodes
    hidden = (2, 40, 64)
    assert _EmulatedHost.puts.count(hidden) >= 3 * 4, _EmulatedHost.puts  # per layer: norms' inputs and outputs
    assert released.count(2 * 40 * 64 * 4) == 3 * 3, released  # each layer's input and output, its parked gradient
    assert abs(loss - reference_loss) <= 1e-6
    worst = max(float((g - p).abs().max() / p.abs().max().clamp_min(1e-12)) for g, p in zip(grads, reference))
    assert worst <= 1e-6, worst


def _trained_with_a_users_hook(monkeypatch, hook) -> list[int]:
    """The CUDA paths emulated on a host (ALST switches + ``offload_attention``), trained once as they are and once
    with ``hook`` registered as a global forward hook: loss and gradients the same (1e-6); the bytes of every storage
    the second run freed."""
    monkeypatch.setattr(offload_attention, "ChunkStore", _EmulatedHost)
    monkeypatch.setattr(layer_checkpoint, "HOST_MIN_BYTES", 1024)
    host = _EmulatedHost(None)
    monkeypatch.setattr(memory, "_offload_to_host", lambda: torch.autograd.graph.saved_tensors_hooks(host.put,
                                                                                                      host.fetch))
    features = memory.MemoryFeatures(tiled_mlp=3, offload_checkpoints=True, ulysses_offload=True)
    reference_loss, reference, _ = _train_step("llama", features)
    released: list[int] = []
    monkeypatch.setattr(_compat, "STORAGE_RELEASED", [*_compat.STORAGE_RELEASED,
                                                      lambda key, nbytes: released.append(nbytes)])
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        loss, grads, _ = _train_step("llama", features)
    finally:
        handle.remove()
    assert abs(loss - reference_loss) <= 1e-6
    worst = max(float((g - p).abs().max() / p.abs().max().clamp_min(1e-12)) for g, p in zip(grads, reference))
    assert worst <= 1e-6, worst
    return released


def test_what_a_users_hook_keeps_of_a_recomputed_layer_is_never_freed(monkeypatch):
    """The same CUDA paths emulated, with a forward hook on every layer's first norm that keeps its input (in the
    recompute: the layer's input as this checkpoint fetched it from the host, whose storage it frees when nothing else
    holds it): nothing a hook holds is freed or changed (the layer is given an alias of the checkpoint's own copy, so
    the hook's tensor shows as a second view of the storage), so 3 fewer storages are freed; the loss and gradients
    stay the same (1e-6)."""
    kept = []

    def keep(module, args, output):
        if type(module).__name__.endswith("RMSNorm") and module.weight.shape == (64,):
            kept.append((args[0], args[0].detach().clone()))

    released = _trained_with_a_users_hook(monkeypatch, keep)
    assert len(kept) >= 3 * 2  # each layer's first norm in the first forward and the recompute (and the final norm)
    assert all(t.untyped_storage().nbytes() > 0 and torch.equal(t, copy) for t, copy in kept)
    assert released.count(2 * 40 * 64 * 4) == 3 * 2, released  # outputs and parked gradients (without the hook: 9)


def test_a_gradient_a_users_tensor_hook_keeps_is_not_parked(monkeypatch):
    """The same CUDA paths emulated, with a tensor hook on every decoder layer's output that keeps its gradient (as
    gradient monitors do): that gradient, which the layer's backward would park in host memory and free on the
    device, stays whole (its references counted against an engine-held gradient's, measured once per process), so 3
    fewer storages are freed (the output's own, the layers below); loss and gradients as before (1e-6)."""
    kept = []

    def keep(module, args, output):
        if type(module).__name__.endswith("DecoderLayer"):
            output.register_hook(lambda grad: kept.append((grad, grad.clone())))

    released = _trained_with_a_users_hook(monkeypatch, keep)
    assert len(kept) == 3
    assert all(g.untyped_storage().nbytes() > 0 and torch.equal(g, copy) for g, copy in kept)
    assert released.count(2 * 40 * 64 * 4) == 3 * 2, released  # inputs and outputs (without the hook: 9)


def test_a_tensor_anything_else_references_is_not_freed(monkeypatch):
    """The release's own checks: a tensor referenced only by the list (and ``held`` names of the checkpoint) is freed;
    one that another list, an attribute or a view also holds keeps its bytes."""
    monkeypatch.setattr(layer_checkpoint, "HOST_MIN_BYTES", 1024)
    alone, in_a_list, viewed, small = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64), torch.randn(4)
    elsewhere = [in_a_list]
    view = viewed[:, :1]
    outputs = (alone, in_a_list, viewed, small)
    assert layer_checkpoint._release_unreferenced(list(outputs), held=2) == 1  # `outputs` and its own name
    assert alone.untyped_storage().nbytes() == 0
    assert all(t.untyped_storage().nbytes() > 0 for t in (in_a_list, viewed, small))
    assert elsewhere and view.shape == (64, 1)


def test_a_keyword_tensor_that_needs_a_gradient_is_checkpointed_by_torch():
    """The strategy's checkpoint returns gradients to the positional tensors only: a layer called with a keyword
    tensor that needs one (a value passed between layers) goes to torch's checkpoint, and that tensor gets its
    gradient."""
    weight = torch.randn(4, 4, requires_grad=True)
    extra = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def layer(hidden: torch.Tensor, *, other: torch.Tensor) -> torch.Tensor:
        return torch.tanh(hidden @ weight + other)

    out = layer_checkpoint.recompute_in_host_memory(functools.partial(layer, other=extra), x)
    assert "_RecomputedLayerBackward" not in _nodes(out)
    out.sum().backward()
    assert extra.grad is not None and x.grad is not None
    plain = torch.autograd.grad(layer(x, other=extra).sum(), (x, extra))
    assert torch.allclose(x.grad, plain[0]) and torch.allclose(extra.grad, plain[1])
    mine = layer_checkpoint.recompute_in_host_memory(functools.partial(layer, other=extra.detach()), x)
    assert "_RecomputedLayerBackward" in _nodes(mine)


def test_the_chunk_store_is_not_filled_without_a_graph(monkeypatch):
    """A forward without a graph (the layer checkpoint's first forward, evaluation) stores nothing for a backward
    that will not run; with one, every chunk's q, k, v, output and log-sum-exp."""
    puts = []

    class Counting(offload_attention.ChunkStore):
        def put(self, tensor):
            puts.append(tensor.shape)
            return super().put(tensor)

    monkeypatch.setattr(offload_attention, "ChunkStore", Counting)
    module = torch.nn.Module()
    q, k, v = torch.randn(1, 4, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    with torch.no_grad():
        offload_attention.offloaded_attention(module, q, k, v, 8, None, {})
    assert puts == []
    offload_attention.offloaded_attention(module, q.requires_grad_(), k, v, 8, None, {})
    assert len(puts) == 3 * 5  # three chunks: k, v, q, output, log-sum-exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_rotary_is_the_models_own_to_the_bit(dtype):
    original = modeling_llama.apply_rotary_pos_emb
    tiled = rotary_tiles._tiled(original)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 8, 16, generator=generator).to(dtype).transpose(1, 2)  # [B, h, S, D] of a projection
    k = torch.randn(2, 2, 37, 16, generator=generator).to(dtype)
    cos, sin = torch.randn(2, 37, 16, generator=generator).to(dtype), torch.randn(2, 37, 16, generator=generator).to(dtype)
    grads = torch.randn(q.shape, generator=generator).to(dtype), torch.randn(k.shape, generator=generator).to(dtype)
    per_position = q.numel() // q.shape[2] * q.element_size()
    rotary_tiles.TILE_BYTES, tile_bytes = 5 * per_position, rotary_tiles.TILE_BYTES  # 37 positions: 8 tiles
    try:
        results = []
        for function in (original, tiled):
            qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
            out = function(qq, kk, cos, sin)
            torch.autograd.backward(out, grads)
            results.append((out, qq.grad, kk.grad, _nodes(out[0])))
    finally:
        rotary_tiles.TILE_BYTES = tile_bytes
    (q0, dq0, dk0, _), (q1, dq1, dk1, nodes) = results
    assert "_TiledRotaryBackward" in nodes
    for a, b in ((q0[0], q1[0]), (q0[1], q1[1]), (dq0, dq1), (dk0, dk1)):
        assert torch.equal(a, b)
    assert q1[0].stride() == q.stride()  # the projection's layout kept: the attention's output can follow it


def test_a_rotary_that_is_not_linear_in_q_runs_as_it_is():
    """The backward runs the function on zeros (it keeps neither q nor k): a function whose gradient depends on q's
    values fails the check and runs whole, with its own backward."""
    def squared(q, k, cos, sin, unsqueeze_dim=1):
        return q * q * cos.unsqueeze(unsqueeze_dim), k * sin.unsqueeze(unsqueeze_dim)

    tiled = rotary_tiles._tiled(squared)
    q, k = torch.randn(1, 2, 40, 8, requires_grad=True), torch.randn(1, 1, 40, 8, requires_grad=True)
    cos, sin = torch.randn(1, 40, 8), torch.randn(1, 40, 8)
    rotary_tiles.TILE_BYTES, tile_bytes = 4 * 2 * 8 * 4, rotary_tiles.TILE_BYTES
    try:
        out = tiled(q, k, cos, sin)
    finally:
        rotary_tiles.TILE_BYTES = tile_bytes
    assert "_TiledRotaryBackward" not in _nodes(out[0])
    out[0].sum().backward()
    assert torch.allclose(q.grad, 2 * q.detach() * cos.unsqueeze(1))


def test_the_modeling_modules_rotary_is_never_replaced():
    """The owned attention block calls the tiled form; the modeling module keeps its own function."""
    original = modeling_llama.apply_rotary_pos_emb
    assert rotary_tiles.tiled(original) is rotary_tiles.tiled(original)  # one tiled form per function
    assert modeling_llama.apply_rotary_pos_emb is original


def _traced(chunk, layers, tokens=65536):
    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1792, num_hidden_layers=layers,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                  max_position_embeddings=1 << 20)
    return activations.trace_layers(config, tokens, dtype=torch.bfloat16, sp=2, gradients_leave=True,
                                    tiled_mlp="auto", tiled_loss="auto", offload_checkpoints=True,
                                    attention_chunk=chunk)


def test_the_planned_step_and_host_memory_with_offload_attention_and_the_alst_switches(monkeypatch):
    """The planner's trace (CUDA's behaviour, shapes only; sp 2, bf16, 64K tokens per rank of a GQA Llama layer):
    the ALST switches alone peak at 10.0 ``[s, H]`` tensors (a checkpointed layer's MLP backward holding its saved
    activations); with ``offload_attention`` the step peaks in a layer's forward at 6.1, at the rotary embedding
    (the embeddings HF keeps, the layer's input, the norm's output, the projected and the rotated queries and keys,
    the cos/sin tables): the strategy runs the attention block itself (offload/attention_block.py), so its q, k and v
    are dropped after the attention call and the values are projected after the rotation (with the model's own
    forward: 6.6 at the output projection),
    and the layer's output gradient is not held while its backward runs; the host holds each layer's checkpoint
    plus one layer's store and saved tensors, not every layer's store (before: every layer's, three times the
    checkpoints)."""
    monkeypatch.setattr(rotary_tiles, "TILE_BYTES", 8 << 20)  # the shard's queries are 64 MiB: 8 tiles
    unit = 65536 * 512 * 2
    alst, switch = _traced(None, 3), _traced(4096, 3)
    assert 9.5 <= alst.peak / unit <= 10.2, alst.peak / unit  # 9.96 here (Llama-3.1-8B's shape: 9.7)
    assert switch.peak / unit <= 6.2, switch.peak / unit  # 6.13 here, cos/sin 0.25 of it (the model's own forward: 6.38)
    per_layer_host = _traced(4096, 4).host - switch.host
    assert per_layer_host == unit, per_layer_host / unit  # one checkpoint ([s, H] bf16) per further layer

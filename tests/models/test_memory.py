"""The tiled MLP's norms (models/memory.py): which modules are tiled, and what tiling them changes: nothing in the
results, the norms' float32 temporaries in the memory. In process, on CPU (the launched exactness against one device
at ZeRO 2 and 3: tests/test_memory_features.py, whose `tiled_mlp` runs tile the norms too)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_ulysses import TensorMemoryTracker
from lightning_ulysses.models import memory

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128)


def _norm_names(model_type: str, finder=memory._decoder_norms, **sizes) -> list[str]:
    config = AutoConfig.for_model(model_type, **COMMON, **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norms = finder(model)
    return [name for name, module in model.named_modules() if any(module is n for n in norms)]


def test_the_norms_of_each_layer_and_the_final_norm_are_tiled():
    assert _norm_names("llama") == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                    "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                                    "model.norm"]
    assert len(_norm_names("gemma3_text", head_dim=16)) == 9  # four per layer ((1 + w) norms) and the final one
    assert _norm_names("gpt2")[-1] == "transformer.ln_f"  # nn.LayerNorm, other names
    qwen3 = _norm_names("qwen3", head_dim=16)
    assert not any("q_norm" in name or "k_norm" in name for name in qwen3)  # per head, inside attention: below
    assert _norm_names("olmo") == []  # parameter-free norms are not recognised by their shape: they run whole


def _attention_norm_names(model_type: str, **sizes) -> list[str]:
    return _norm_names(model_type, memory._attention_norms, **sizes)


def test_the_query_and_key_norms_inside_attention_are_found():
    per_layer = ["self_attn.q_norm", "self_attn.k_norm"]
    expected = [f"model.layers.{i}.{name}" for i in range(2) for name in per_layer]
    assert _attention_norm_names("qwen3", head_dim=16) == expected  # [head_dim] over [B, s, h, D]
    assert _attention_norm_names("olmo2") == expected  # [heads·head_dim] and [kv_heads·head_dim] over [B, s, ·]
    assert _attention_norm_names("llama") == [] and _attention_norm_names("gpt2") == []
    assert _attention_norm_names("cohere") == []  # [heads, head_dim] weights: not one-dimensional, left alone


@pytest.mark.parametrize("model_type,sizes", [("qwen3", {"head_dim": 32}), ("olmo2", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_query_and_key_norms_give_the_same_gradients_and_drop_their_temporaries(model_type, sizes, dtype):
    """Qwen3's and OLMo 2's q/k norms, tiled over their rows with the MLP (``tiled_mlp``): the same loss and
    gradients (:func:`assert_same_gradients`), and with the layers checkpointed a lower peak (the norms' eager
    backward held several float32 copies of the projections)."""
    results = {}
    for tiled in (False, True):
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **{**COMMON, "hidden_size": 128, "num_hidden_layers": 2, **sizes},
                                      attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        original = memory._attention_norms
        if not tiled:
            memory._attention_norms = lambda model: []
        try:
            memory.enable(model, memory.MemoryFeatures(tiled_mlp=8, offload_checkpoints=True), None)
            ids = torch.randint(0, 128, (1, 1024), generator=torch.Generator().manual_seed(1))
            with TensorMemoryTracker() as tracker:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            memory.disable(model)
        finally:
            memory._attention_norms = original
        results[tiled] = (tracker.result().peak_bytes, [p.grad.float() for p in model.parameters()], float(loss))
        if dtype == torch.bfloat16 and not tiled:  # the float64 run bf16's errors are measured against
            model64 = AutoModelForCausalLM.from_config(config).double()
            model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            model64(input_ids=ids, labels=ids).loss.backward()
            results["exact"] = [p.grad for p in model64.parameters()]
    (plain_peak, plain_grads, plain_loss), (tiled_peak, tiled_grads, tiled_loss) = results[False], results[True]
    assert tiled_loss == plain_loss
    assert_same_gradients(tiled_grads, plain_grads, dtype, results.get("exact"))
    hidden_bytes = 1024 * 128 * torch.finfo(dtype).bits // 8  # one [s, H] tensor
    print(f"[measured] {model_type} {dtype}: peak {plain_peak / hidden_bytes:.1f} -> {tiled_peak / hidden_bytes:.1f}")
    assert tiled_peak <= plain_peak - (2 if dtype == torch.bfloat16 else 1) * hidden_bytes


def test_a_norm_that_is_not_the_same_on_rows_runs_whole():
    """A module whose output depends on its input's layout (here it normalises over the positions, dim 1) is not
    tiled over rows: the check on a few positions sees the difference."""

    class OverPositions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.weight * x / x.norm(dim=1, keepdim=True)

    module = OverPositions()
    x = torch.randn(1, 16, 2, 8)
    expected = module(x)
    memory._tile_mlp(module, 4, 16, None, rows=True)
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
    assert memory._ROWS_VERDICTS[module][(torch.float32, 4, 8, "cpu")] is False


def assert_same_gradients(tiled: list[torch.Tensor], plain: list[torch.Tensor], dtype: torch.dtype,
                          exact: list[torch.Tensor] | None = None) -> None:
    """fp32: within 1e-6 of the largest. bf16: each gradient's error against a float64 run (``exact``) at most twice
    the untiled bf16 run's plus one bf16 step of the largest (the summation order differs between tiles and the
    whole, and bf16 kernels differ between CPUs: on an AVX512-BF16 EPYC a fixed 1e-2 of the largest failed by 1.3e-2)."""
    for index, (a, b) in enumerate(zip(tiled, plain)):
        if dtype == torch.float32:
            assert (a - b).abs().max() <= 1e-6 * b.abs().max() + 1e-12, index
            continue
        reference = exact[index].float()
        own, untiled = float((a - reference).abs().max()), float((b - reference).abs().max())
        assert own <= 2 * untiled + 2 ** -8 * float(reference.abs().max()), (index, own, untiled)


def _step(dtype: torch.dtype, tiled_norms: bool, monkeypatch) -> tuple[int, list[torch.Tensor], float]:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**COMMON, "hidden_size": 128, "num_hidden_layers": 3},
                                  attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if not tiled_norms:
        monkeypatch.setattr(memory, "_decoder_norms", lambda model: [])
    memory.enable(model, memory.MemoryFeatures(tiled_mlp=8, offload_checkpoints=True), None)
    ids = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(1))
    with TensorMemoryTracker() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    memory.disable(model)
    monkeypatch.undo()
    return tracker.result().peak_bytes, [p.grad.float() for p in model.parameters()], float(loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_norms_give_the_same_gradients_and_drop_their_temporaries(dtype, monkeypatch):
    """With the layers checkpointed the norms' eager backward is the step's largest moment (in bf16 several float32
    ``[s, H]`` temporaries at once); tiled, the peak falls and the loss and gradients stay (:func:`assert_same_gradients`)."""
    plain_peak, plain_grads, plain_loss = _step(dtype, False, monkeypatch)
    tiled_peak, tiled_grads, tiled_loss = _step(dtype, True, monkeypatch)
    assert tiled_loss == plain_loss
    exact = _step(torch.float64, False, monkeypatch)[1] if dtype == torch.bfloat16 else None
    assert_same_gradients(tiled_grads, plain_grads, dtype, exact)
    hidden_bytes = 2048 * 128 * torch.finfo(dtype).bits // 8  # one [s, H] tensor
    print(f"[measured] {dtype}: peak {plain_peak / hidden_bytes:.1f} -> {tiled_peak / hidden_bytes:.1f} [s, H] tensors")
    assert tiled_peak <= plain_peak - (4 if dtype == torch.bfloat16 else 1) * hidden_bytes


def test_a_tiled_norm_after_frozen_embeddings_still_trains_its_weight():
    """The first norm's input comes from the embedding: frozen, it carries no gradient, and the norm's weight (not an
    input of the tiled node) must still get its own: equal to the untiled model's."""
    grads = []
    for tiled in (False, True):
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **COMMON, attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(config)
        model.get_input_embeddings().weight.requires_grad_(False)
        if tiled:
            memory.enable(model, memory.MemoryFeatures(tiled_mlp=4), None)
        ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        norm = model.model.layers[0].input_layernorm.weight
        assert norm.grad is not None
        grads.append(norm.grad.clone())
        memory.disable(model)
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_a_tile_recomputed_in_backward_draws_the_dropout_masks_of_its_forward():
    """GPT-2's MLP drops out (resid_pdrop) in training: each tile recomputed in backward must draw the masks its
    forward drew, or the gradients are not those of the loss (the same loss, gradients off by 0.8 of their size
    before the random state was replayed). One row on CPU: the tiles draw the whole MLP's masks in the same order, so
    the tiled model equals the untiled one."""
    results = []
    for tiled in (False, True):
        torch.manual_seed(0)
        config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                      resid_pdrop=0.3, embd_pdrop=0.0, attn_pdrop=0.0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
        if tiled:
            memory.enable(model, memory.MemoryFeatures(tiled_mlp=3), None)
        ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        after = torch.rand(1)  # the generator after the step: backward's replay leaves it where forward did
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}, after))
        memory.disable(model)
    (loss_a, grads_a, after_a), (loss_b, grads_b, after_b) = results
    assert loss_a == loss_b and torch.equal(after_a, after_b)
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-8, name

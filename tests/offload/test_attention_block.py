"""offload/attention_block.py: the attention block the strategy runs itself under ``offload_attention`` for the
families registered in families/attention_blocks.py, in process (its launched training: tests/test_offload_attention.py
and tests/test_user_references.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from lightning_ulysses.families import attention_blocks
from lightning_ulysses.offload import attention_block, rotary_tiles

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=96, max_position_embeddings=256)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _model(model_type: str, **extra) -> nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SIZES, **extra)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def test_every_registered_recipe_matches_the_installed_transformers():
    """A recipe names its class and the digest of the forward it was written from: both found here (a newer
    transformers whose forward differs runs the model's own forward: the next test)."""
    for model_type in FAMILIES:
        modules = _attention_modules(_model(model_type))
        assert modules and all(attention_block.recipe_of(m) is not None for m in modules), model_type
    assert len(attention_blocks.OWNED_ATTENTION_BLOCKS) == len(FAMILIES)


def test_only_an_exact_match_is_owned(monkeypatch):
    model = _model("llama")
    first, second = _attention_modules(model)

    class StoresQuery(type(first)):  # a subclass with its own forward: its code runs, not a recipe
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class SameForward(type(first)):  # inherits the registered forward: the recipe describes it
        pass

    first.__class__ = StoresQuery
    second.__class__ = SameForward
    assert attention_block.recipe_of(first) is None
    assert attention_block.recipe_of(second) is not None
    second.forward = lambda *a, **k: None  # a replaced instance forward
    assert attention_block.recipe_of(second) is None
    gemma = _attention_modules(_model("gemma"))
    assert all(attention_block.recipe_of(m) is None for m in gemma)  # no recipe registered
    recipe = attention_blocks.OWNED_ATTENTION_BLOCKS[0]
    changed = (attention_blocks.AttentionBlockRecipe(recipe.modeling_module, recipe.attention_class, "0" * 16),)
    monkeypatch.setattr(attention_blocks, "OWNED_ATTENTION_BLOCKS", changed + attention_blocks.OWNED_ATTENTION_BLOCKS[1:])
    monkeypatch.setattr(attention_block, "_warned", set())
    with pytest.warns(UserWarning, match="LlamaAttention.forward differs from the source"):
        assert all(attention_block.recipe_of(m) is None for m in _attention_modules(_model("llama")))


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_owned_block_is_the_models_forward_to_the_bit_and_keeps_every_hooks_tensor(model_type, monkeypatch):
    """fp32, 40 positions, the rotary cut into 7 tiles: loss and every gradient bit for bit; a forward hook on every
    projection that keeps its output sees the same tensors, as many times, and none of them is changed after the
    block returned (the strategy only drops its own references)."""
    extra = {"sliding_window": 16, "use_sliding_window": True} if model_type == "qwen2" else {}
    model = _model(model_type, **extra)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(rotary_tiles, "TILE_BYTES", 6 * 4 * 16 * 4)  # 6 positions of a [B, 4, S, 16] query

    def run_keeping() -> tuple:
        kept: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        handles = [module.register_forward_hook(lambda m, i, o, name=name: kept.append((name, o, o.clone())))
                   for name, module in model.named_modules() if name.endswith(("q_proj", "k_proj", "v_proj"))]
        try:
            loss, grads = _run(model, ids)
        finally:
            for handle in handles:
                handle.remove()
        return loss, grads, kept

    loss0, grads0, kept0 = run_keeping()
    calls = attention_block.OWNED_CALLS[0]
    owned = attention_block.install(model)
    try:
        assert len(owned) == SIZES["num_hidden_layers"]
        loss1, grads1, kept1 = run_keeping()
    finally:
        attention_block.uninstall(owned)
    assert attention_block.OWNED_CALLS[0] - calls == SIZES["num_hidden_layers"]
    assert all("forward" not in vars(m) for m in owned)  # uninstalled
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert sorted(name for name, _, _ in kept0) == sorted(name for name, _, _ in kept1)
    for name, held, copy in kept1:
        assert torch.equal(held, copy), name  # what the hook holds was not rewritten or released
    by_name = {name: copy for name, _, copy in kept0}
    assert all(torch.equal(by_name[name], copy) for name, _, copy in kept1)
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"  # the modeling module's own


def test_a_call_with_a_cache_runs_the_modules_own_forward():
    model = _model("llama").eval()
    ids = torch.randint(0, SIZES["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    owned = attention_block.install(model)
    calls = attention_block.OWNED_CALLS[0]
    try:
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        attention_block.uninstall(owned)
    assert torch.equal(expected, got)
    assert attention_block.OWNED_CALLS[0] == calls  # every call carried the cache

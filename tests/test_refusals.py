"""The refusals classify a model by its structure, never by reading the source of a forward: wrapping the forwards of
the model and of its attention modules (a ``functools.wraps`` wrapper, a closure as ``torch.compile`` returns, a
subclass whose forward only calls the original) leaves every decision as it was. In-process, tiny models."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from lightning_ulysses.models import refusals
from tests.support.architectures import build_model

# full attention, direct SDPA calls, an implementation refused, the router loss made exact, sequence mixers (one
# of them named "...Attention"), ALiBi and a known unshardable type
CASES = ["llama", "falcon", "gptj_eager", "qwen3_moe_aux_loss", "lfm2", "minimax", "kimi_linear", "falcon_alibi",
         "doge"]


def classification(model: nn.Module) -> dict:
    """Every decision the refusals make about ``model``."""
    def outcome(*args) -> str | None:
        try:
            refusals.validate_model(model, *args)
        except ValueError as err:
            return str(err)
        return None

    mixers = refusals.sequence_mixers(model)
    return {
        "kinds": {name: refusals._attention_kind(m) for name, m in model.named_modules()
                  if refusals._attention_kind(m) is not None},
        "direct_sdpa": sorted(name for name, m in model.named_modules() if refusals.calls_sdpa_directly(m)),
        "has_attention": refusals.has_attention(model),
        "mixers": sorted(name for name, m in model.named_modules() if any(m is x for x in mixers)),
        "cpu": outcome(2, "cpu"),
        "cuda": outcome(2, "cuda"),
        "ring": outcome(4, "cuda", 2),
    }


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def wrap_with_functools(model: nn.Module) -> None:
    for module in [model, *_attention_modules(model)]:
        original = module.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            return _original(*args, **kwargs)

        module.forward = forward


def wrap_like_compile(model: nn.Module) -> None:
    """A new callable with nothing of the original's (no ``__wrapped__``, no source), as ``torch.compile`` gives."""
    for module in [model, *_attention_modules(model)]:
        module.forward = (lambda original: lambda *args, **kwargs: original(*args, **kwargs))(module.forward)


def wrap_in_subclasses(model: nn.Module) -> None:
    """Each attention module's class replaced by a subclass defined here, same name, whose forward only calls the
    original (what a decorator on the class does); the model's class likewise, kept in its modeling module."""
    def subclass(cls: type, module_name: str) -> type:
        def forward(self, *args, **kwargs):
            return cls.forward(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"forward": forward, "__module__": module_name})

    classes: dict[type, type] = {}
    for module in _attention_modules(model):
        cls = type(module)
        module.__class__ = classes.setdefault(cls, subclass(cls, __name__))
    model.__class__ = subclass(type(model), type(model).__module__)


@pytest.mark.parametrize("wrap", [wrap_with_functools, wrap_like_compile, wrap_in_subclasses])
@pytest.mark.parametrize("name", CASES)
def test_wrapped_forwards_are_classified_the_same(name, wrap):
    model = build_model(name)
    before = classification(model)
    wrap(model)
    assert classification(model) == before


def test_the_cases_cover_each_decision():
    """The comparison above is between meaningful classifications, not empty ones."""
    got = {name: classification(build_model(name)) for name in CASES}
    assert got["llama"]["cpu"] is None and set(got["llama"]["kinds"].values()) == {"interface"}
    assert got["falcon"]["cpu"] is None and got["falcon"]["direct_sdpa"]
    assert "GPTJForCausalLM supports [" in got["gptj_eager"]["cpu"]
    assert "'flash_attention_2', 'flash_attention_3'" in got["gptj_eager"]["cpu"]
    assert got["qwen3_moe_aux_loss"]["cpu"] is None  # its router loss is made exact, not refused
    assert got["lfm2"]["mixers"] and got["lfm2"]["cpu"] is None
    assert "own" in got["kimi_linear"]["kinds"].values() and got["kimi_linear"]["cpu"] is None  # its delta attention
    assert "ALiBi" in got["falcon_alibi"]["cpu"]
    assert "attention_mask" in got["doge"]["cpu"]
    assert "ring_size=1" in got["minimax"]["ring"]


def test_router_loss_of_a_modeling_module_moe_does_not_replace_is_refused():
    """A model whose class lives outside its modeling module: lightning_ulysses.models.moe replaces the router loss of the
    model's own module only, so the transformers one its base class calls would see this rank's tokens: refused."""
    model = build_model("qwen3_moe_aux_loss")
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"__module__": __name__})
    with pytest.raises(ValueError, match="output_router_logits=True"):
        refusals.validate_model(model, 2, "cpu")

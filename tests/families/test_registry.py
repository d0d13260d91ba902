"""The family registry (``lightning_ulysses/families``) is the one place that names model families: the package's
source names no model type and no family's transformers class anywhere else, and every name the registry holds still
exists in the installed transformers (the class tables are re-derived from its sources). In-process."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lightning_ulysses
from lightning_ulysses import families
from lightning_ulysses.families.attention_classes import CALLS_SDPA_ITSELF, NOT_THROUGH_INTERFACE
from lightning_ulysses.families.multimodal_positions import PACKING_FROM_FOUR_ROWS
from lightning_ulysses.families.unshardable import KNOWN_UNSHARDABLE

PACKAGE = Path(lightning_ulysses.__file__).parent
REGISTRY = PACKAGE / "families"

# transformers' (and torch's, Lightning's) generic API: names of no family.
GENERIC_NAMES = {"PreTrainedModel", "PretrainedConfig", "PreTrainedConfig", "GenerationMixin", "AutoConfig",
                 "AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForImageTextToText",
                 "AttentionInterface", "Cache",
                 "DataCollatorWithFlattening", "Trainer", "DistributedSampler"}


@pytest.fixture(scope="module")
def family_names() -> tuple[set[str], set[str], re.Pattern]:
    """(model types, transformers' exported names, a pattern of family class names: a family's prefix followed by a
    capitalised part, such as ``LlamaAttention``)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    exported = {name for name in dir(transformers) if name[:1].isupper()} - GENERIC_NAMES
    prefixes = {m.group(1) for name in exported
                if (m := re.match(r"([A-Z][A-Za-z0-9]*?)(PreTrainedModel|Model|ForCausalLM|Config)$", name))}
    prefixes = {p for p in prefixes if len(p) > 2} - {"Auto", "Pre", "Base", "Text", "Vision", "Encoder", "Decoder",
                                                   "Generation"}
    pattern = re.compile(r"(?:%s)[A-Z0-9]\w*$" % "|".join(sorted(map(re.escape, prefixes), key=len, reverse=True)))
    return {t for t in CONFIG_MAPPING_NAMES if len(t) > 3}, exported, pattern


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _family_names_in(path: Path, model_types: set[str], exported: set[str], pattern: re.Pattern) -> list[str]:
    """The family names the code of ``path`` holds: in its string constants (docstrings aside) and identifiers."""
    tree = ast.parse(path.read_text())
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = re.findall(r"[A-Za-z0-9_]+", node.value)
        elif isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        found += [f"line {node.lineno}: {w}" for w in words
                  if w in model_types or w in exported
                  or (w not in GENERIC_NAMES and not w.isupper() and pattern.match(w))]
    return found


def test_no_family_is_named_outside_the_registry(family_names):
    model_types, exported, pattern = family_names
    outside = {str(path.relative_to(PACKAGE)): names for path in sorted(PACKAGE.rglob("*.py"))
               if REGISTRY not in path.parents and (names := _family_names_in(path, model_types, exported, pattern))}
    assert not outside, f"family names outside lightning_ulysses/families: {outside}"


def test_the_scan_finds_family_names(family_names, tmp_path):
    """The check above can fail: a class-name table, a model-type test and a transformers class are each found."""
    source = tmp_path / "named.py"
    source.write_text('"""LlamaAttention in a docstring is fine."""\n'
                      'TABLE = {"DbrxExperts", "GptOssAttention"}\n'
                      'def f(config):\n    return config.model_type == "roberta"\n'
                      'from transformers import LlamaForCausalLM\nx = LlamaForCausalLM\n')
    names = [n.split(": ")[1] for n in _family_names_in(source, *family_names)]
    assert names.count("DbrxExperts") == names.count("GptOssAttention") == names.count("roberta") == 1
    assert "LlamaForCausalLM" in names and "LlamaAttention" not in names


def test_every_named_model_type_exists_in_transformers():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    named = set(KNOWN_UNSHARDABLE) | set(families.vision.SUPPORTED_FAMILIES) | PACKING_FROM_FOUR_ROWS
    assert named <= set(CONFIG_MAPPING_NAMES), sorted(named - set(CONFIG_MAPPING_NAMES))
    assert families.named_model_types() == sorted(named)


def test_the_facts_of_a_model_type():
    qwen = families.facts_of("qwen2_vl")
    assert qwen.vision_family is families.vision.family_of("qwen2_vl") and qwen.packs_from_four_rows
    assert qwen.named and not qwen.unshardable
    doge = families.facts_of("doge")
    assert "mask" in doge.unshardable and doge.vision_family is None and not doge.packs_from_four_rows
    assert not families.facts_of("llama").named and not families.facts_of(None).named


def test_the_attention_class_tables_are_the_installed_transformers():
    """Re-derived from the installed modeling sources: the attention classes (``...Attention<n>``) whose own forward
    calls ``scaled_dot_product_attention`` without the attention interface are exactly :data:`CALLS_SDPA_ITSELF`, and
    every class of :data:`NOT_THROUGH_INTERFACE` is still defined."""
    import transformers

    defined: set[str] = set()
    calls_sdpa: set[str] = set()
    for path in (Path(transformers.__file__).parent / "models").rglob("modeling_*.py"):
        source = path.read_text()
        defined.update(re.findall(r"^class (\w+)\(", source, re.MULTILINE))
        if "scaled_dot_product_attention" not in source:
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and re.search(r"Attention\d*$", node.name):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "forward":
                        body = ast.get_source_segment(source, item)
                        if "scaled_dot_product_attention" in body and "ALL_ATTENTION_FUNCTIONS" not in body:
                            calls_sdpa.add(node.name)
    assert calls_sdpa == CALLS_SDPA_ITSELF, (sorted(calls_sdpa - CALLS_SDPA_ITSELF), sorted(CALLS_SDPA_ITSELF - calls_sdpa))
    assert NOT_THROUGH_INTERFACE <= defined, sorted(NOT_THROUGH_INTERFACE - defined)

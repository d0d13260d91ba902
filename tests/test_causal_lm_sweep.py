"""The sweep over every ``*ForCausalLM`` of the installed transformers (``docs/causal-lm-sweep.md``, written by
``python benchmarks/causal_lm_sweep.py`` in ~3-4 min on a 2-core CPU) stays true here, in the suite's time:

* in process: the recorded table has a row for every ``*ForCausalLM`` class of the installed transformers (a
  transformers upgrade adding one fails here, naming it and the command to rerun), and each still builds with the
  sweep's shrinking (one plain forward and backward) exactly when the table says it does (~200 tiny models, ~10 s);
* one launch of 2 processes: a fixed sample of model types outside the hand-made matrix (which
  ``tests/test_architectures.py`` runs) gets its recorded outcome again (exact: within the bounds; refused: the same
  message), and a smaller sample its recorded outcome at the other settings (ZeRO 3 partitioned, bf16, packed rows);
* every model type exact at ZeRO 2 is, in the recorded table, exact at the other settings, refused there before
  compute or not applicable (no WRONG or crashed cell without a recorded cause).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import sweep
from tests.support.launcher import launch

RERUN = (f"rerun `{sweep.COMMAND}` (`--only <model types>` for some rows) and commit docs/causal-lm-sweep.md and "
         "benchmarks/results/causal_lm_sweep.json")

# Outside tests/support/architectures.py, all shrunk generically; recorded exact or refused by the sweep: DeepSeek V2
# (latent attention + MoE) and GLM-4 MoE exact, Apertus (Llama-shaped, its own activation) exact; MPT (ALiBi inside its
# own attention) refused, BART's decoder stopped by the model-form check, HY V4 (indexed attention) refused.
SAMPLE = ["deepseek_v2", "glm4_moe", "apertus", "mpt", "bart", "hy_v4"]
# at ZeRO 3 partitioned, bf16 and packed rows: latent attention with its family's ratio of value to query/key head
# sizes (20 / 32) and an MoE; a Llama-shaped decoder; GPT-2 (learned absolute positions); Granite-SWA (attention
# sinks and sliding windows: one sink call per packed document)
SETTINGS_SAMPLE = ["deepseek_v2", "apertus", "gpt2", "granite_swa"]


def test_the_table_covers_every_causal_lm_class():
    classes = sweep.causal_lm_classes()
    recorded = sweep.recorded()
    missing = {m: c for m, c in classes.items() if m not in recorded}
    assert not missing, f"*ForCausalLM classes of this transformers not in the sweep's table: {missing}: {RERUN}"
    moved = {m: (recorded[m]["class"], c) for m, c in classes.items() if recorded[m]["class"] != c}
    assert not moved, f"model types whose class changed (recorded, installed): {moved}: {RERUN}"
    gone = sorted(set(recorded) - set(classes))
    assert not gone, f"model types in the sweep's table that this transformers does not have: {gone}: {RERUN}"
    table = sweep.TABLE.read_text()
    absent = [m for m in classes if f"| `{m}`" not in table]
    assert not absent, f"rows missing from {sweep.TABLE.name}: {absent}: {RERUN}"


def _builds(model_type: str, class_name: str) -> tuple[bool, str]:
    """Built tiny, one plain forward and backward with a finite loss."""
    try:
        model = sweep.build(model_type, class_name)
        loss = model(**sweep.batches(1)[0], **sweep.forward_kwargs(model_type)).loss
        if loss is None or not torch.isfinite(loss):
            return False, f"loss {loss}"
        loss.backward()
    except Exception as err:  # noqa: BLE001 - reported
        return False, sweep.first_line(err)
    return True, ""


def test_every_class_builds_exactly_when_the_table_says_so():
    recorded = sweep.recorded()
    changed = []
    for model_type, class_name in sweep.causal_lm_classes().items():
        if model_type not in recorded:
            continue  # named by test_the_table_covers_every_causal_lm_class
        builds, why = _builds(model_type, class_name)
        if builds != (recorded[model_type]["outcome"] != sweep.NOT_BUILDING):
            changed.append(f"{model_type} ({class_name}): " + (f"no longer builds: {why}" if not builds else
                                                              "builds now, recorded as not building"))
    assert not changed, "\n".join(changed) + f"\n{RERUN}"


@pytest.fixture(scope="module")
def sample_results():
    classes = sweep.causal_lm_classes()
    by_rank = launch(2, "causal_lm_sweep:run", {"models": {m: classes[m] for m in SAMPLE}, "steps": sweep.STEPS,
                                                "model_timeout": 120}, timeout=300)
    return {m: [r[m] for r in by_rank] for m in SAMPLE}


@pytest.fixture(scope="module")
def settings_results():
    classes = sweep.causal_lm_classes()
    settings = list(sweep.SETTINGS[1:])
    by_rank = launch(2, "causal_lm_sweep:run", {"models": {m: classes[m] for m in SETTINGS_SAMPLE}, "steps":
                                                sweep.STEPS, "settings": settings, "model_timeout": 120}, timeout=300)
    return {(m, s): [r[f"{m}@{s}"] for r in by_rank] for m in SETTINGS_SAMPLE for s in settings}


def test_the_sample_is_outside_the_matrix_and_recorded_exact_or_refused():
    recorded = sweep.recorded()
    assert len(SAMPLE) >= 4
    for model_type in SAMPLE:
        assert not sweep.hand_made_parts(model_type), f"{model_type}: tests/test_architectures.py runs it already"
        assert recorded[model_type]["outcome"] in (sweep.EXACT, sweep.REFUSED), recorded[model_type]
    assert {recorded[m]["outcome"] for m in SAMPLE} == {sweep.EXACT, sweep.REFUSED}


@pytest.mark.parametrize("model_type", SAMPLE)
def test_the_sample_gets_its_recorded_outcome(sample_results, model_type):
    want = sweep.recorded()[model_type]
    got = sweep.classify(model_type, sweep.train_reference(model_type), sample_results[model_type])
    if got["outcome"] in (sweep.EXACT, sweep.WRONG):
        print(f"[measured] {model_type}: loss {got['loss_diff']:.1e}, weight update {got['update_diff']:.1e}"
              f" ({got['worst_param']})")
    assert got["outcome"] == want["outcome"], (got, want)
    if want["outcome"] == sweep.REFUSED:
        assert got["reason"][:100] == want["reason"][:100], (got["reason"], want["reason"])


def _recorded_setting(model_type: str, setting: str) -> dict:
    return sweep.recorded()[model_type].get("settings", {}).get(setting, {"outcome": sweep.NOT_RUN})


@pytest.mark.parametrize("setting", sweep.SETTINGS[1:])
@pytest.mark.parametrize("model_type", SETTINGS_SAMPLE)
def test_the_sample_gets_its_recorded_outcome_at_every_setting(settings_results, model_type, setting):
    want = _recorded_setting(model_type, setting)
    assert want["outcome"] == sweep.EXACT, want  # the sample is chosen exact: the comparison must run
    reference = sweep.train_reference(model_type, setting=setting)
    got = sweep.classify(model_type, reference, settings_results[(model_type, setting)], setting)
    if setting in (sweep.BF16, sweep.BF16_PACKED):
        print(f"[measured] {model_type} {setting}: SP/one-device error, loss {got['loss_ratio']:.2f}x, update "
              f"{got['update_ratio']:.2f}x")
    else:
        print(f"[measured] {model_type} {setting}: loss {got['loss_diff']:.1e}, update {got['update_diff']:.1e}")
    assert got["outcome"] == sweep.EXACT, got


def test_every_row_exact_at_zero2_is_exact_or_refused_at_every_setting():
    """The recorded table: a model type exact at ZeRO 2 is exact at the other settings, refused before compute, or
    the setting does not apply (without SP either); a WRONG or crashed cell needs a recorded cause
    (``benchmarks/causal_lm_sweep.py``'s FINDINGS) that is not the strategy's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("causal_lm_sweep_benchmark",
                                                  sweep.REPO_ROOT / "benchmarks" / "causal_lm_sweep.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    bad = []
    for model_type, row in sweep.recorded().items():
        if row["outcome"] != sweep.EXACT:
            continue
        for setting in sweep.SETTINGS[1:]:
            outcome = _recorded_setting(model_type, setting)["outcome"]
            if outcome not in (sweep.EXACT, sweep.REFUSED, sweep.NOT_APPLICABLE) and not benchmark._finding(model_type):
                bad.append(f"{model_type} at {setting}: {outcome}")
    assert not bad, bad
    header = next(line for line in sweep.TABLE.read_text().splitlines() if line.startswith("| model_type"))
    assert all(title in header for title in benchmark.COLUMN_TITLES.values()), header

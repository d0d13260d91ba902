"""The architecture matrix: every tiny architecture of ``tests/support/architectures.py`` either trains at SP=2 exactly like
a plain single process (per-step losses within 1e-5, every parameter's weight update within 1e-4, relative) or
stops with a clear error before compute. One launch of 2 gloo processes runs them all."""

from __future__ import annotations

import pytest
import torch

from tests.support.architectures import ARCHITECTURES, train_plain
from tests.support.launcher import launch

STEPS, LR = 3, 0.5
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4
EXACT = [n for n, e in ARCHITECTURES.items() if "expect" not in e]
REFUSED = [n for n, e in ARCHITECTURES.items() if "expect" in e]


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "architectures:run",
                     {"names": list(ARCHITECTURES), "steps": STEPS, "lr": LR}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in ARCHITECTURES}


def test_the_matrix_is_wide():
    assert len(ARCHITECTURES) >= 25 and len(EXACT) >= 25


# The newest families again at ZeRO 3 with every parameter partitioned (stage3_param_persistence_threshold=0).
# JetMoE and DBRX read parameters of another module: the model-form check's probe gathers them as the engine's
# forward does; DBRX's experts call their `mlp` once per expert hit and run as a ZeRO-3 leaf module
# (lightning_ulysses/models/cross_module_reads.py), or the ranks' all-gathers would differ and hang. RoBERTa numbers
# its own positions: ZeRO-3's hooks hand the model detached copies of the batch's filled positions, which the call
# completion recognises by their memory (by object identity it was silently wrong here: update 1.3 off).
ZERO3 = ["llama4_text", "gpt_oss", "afmoe", "gemma4_text", "jetmoe", "dbrx", "roberta", "deepseek_v3_mla_heads"]


@pytest.fixture(scope="module")
def results_zero3():
    by_rank = launch(2, "architectures:run", {"names": ZERO3, "steps": STEPS, "lr": LR, "stage": 3}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in ZERO3}


@pytest.mark.parametrize("name", ZERO3)
def test_newest_families_train_exactly_at_zero3_partitioned(results_zero3, name):
    test_architecture_trains_exactly(results_zero3, name)


@pytest.mark.parametrize("name", EXACT)
def test_architecture_trains_exactly(results, name):
    ranks = results[name]
    for r in ranks:
        assert r["error"] is None, r["error"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    reference = train_plain(name, STEPS, ARCHITECTURES[name].get("lr", LR))
    got, want = torch.tensor(ranks[0]["losses"]), torch.tensor(reference["losses"])
    loss_diff = ((got - want).abs() / want.abs()).max().item()
    assert loss_diff <= LOSS_TOL, (got, want)
    worst, worst_name = 0.0, None
    for param, initial in reference["initial"].items():
        expected = reference["final"][param] - initial
        actual = ranks[0]["final"][param] - initial
        scale = expected.norm().item()
        # A weight holds its update at its own resolution: one ulp of the final weight is the smallest difference
        # there is, so it counts as none (dt_bias ≈ 1 moving 1e-5 a step: one ulp is 1.6e-4 of its update).
        final = reference["final"][param]
        ulp = (torch.nextafter(final, torch.full_like(final, float("inf"))) - final).abs()
        diff = ((actual - expected).abs() - ulp).clamp_min(0).norm().item()
        # An update that is numerically zero (e.g. a key bias: softmax ignores it) is compared absolutely.
        rel = diff / scale if scale > 1e-6 else diff / 1e-6
        if rel > worst:
            worst, worst_name = rel, param
    print(f"[measured] {name}: loss {loss_diff:.1e}, weight update {worst:.1e} ({worst_name})")
    assert worst <= ARCHITECTURES[name].get("update_tol", UPDATE_TOL), (worst_name, worst)


@pytest.mark.parametrize("name", REFUSED)
def test_architecture_is_refused_before_compute(results, name):
    for r in results[name]:
        assert r["error"] is not None, f"{name} trained instead of being refused"
        assert r["error"].startswith("ValueError"), r["error"]
        assert ARCHITECTURES[name]["expect"] in r["error"], r["error"]
        assert "losses" not in r  # stopped before any step


WITH_MIXERS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "nemotron_h", "bamba",
               "granitemoehybrid", "falcon_h1", "falcon_h1_no_norm", "zamba2", "mamba2", "lfm2", "lfm2_moe", "lfm3", "minimax", "jamba",
               "mamba", "falcon_mamba", "qwen3_5_text_3_heads", "kimi_linear_3_heads", "falcon_h1_3_heads",
               "minimax_3_heads"]


@pytest.mark.parametrize("name", WITH_MIXERS)
def test_every_mixer_splits_its_heads(results, name):
    """Every sequence mixer of the families is claimed by a head-parallel recipe (none runs whole on every rank), and
    the two ranks together hold each head (channel) once: uneven counts where sp=2 does not divide them."""
    ranks = [r["mixer_families"] for r in results[name]]
    assert ranks[0], f"{name}: no sequence mixer found"
    for mixer, family, split in ranks[0]:
        assert family is not None, f"{name}: {mixer} runs whole"
    if name.endswith("_3_heads"):
        heads = [[v for k, v in split.items() if "head" in k] for _, _, split in (r[0] for r in ranks)]
        assert sorted(h[0] for h in heads) == [1, 2], heads  # 3 heads: rank 0 takes 2, rank 1 takes 1


def test_gemma4_update_bound_is_the_models_own_fp32_noise():
    """Gemma 4's wider update bound is its own rounding on one device: sdpa and eager, both plain, one process, differ
    by more than the default bound (Llama's differ by 3e-5), and by less than the Gemma 4 bound."""
    import copy

    from tests.support import architectures

    sdpa = train_plain("gemma4_text", STEPS, LR)
    saved = copy.deepcopy(architectures.ARCHITECTURES["gemma4_text"])
    try:
        architectures.ARCHITECTURES["gemma4_text"]["attn"] = "eager"
        eager = train_plain("gemma4_text", STEPS, LR)
    finally:
        architectures.ARCHITECTURES["gemma4_text"] = saved
    noise = max(float((eager["final"][p] - sdpa["final"][p]).norm() / (sdpa["final"][p] - initial).norm())
                for p, initial in sdpa["initial"].items() if float((sdpa["final"][p] - initial).norm()) > 1e-6)
    print(f"[measured] gemma4_text, one device, sdpa vs eager: update difference {noise:.1e}")
    assert UPDATE_TOL < noise < ARCHITECTURES["gemma4_text"]["update_tol"]


@pytest.fixture(scope="module")
def results_float64():
    """Gemma 4 and Llama in float64, one SGD step (DeepSpeed keeps fp32 master weights: the reference steps fp32
    masters as it does, so that the two runs differ only in their float64 forward and backward)."""
    names = ["gemma4_text", "llama"]
    by_rank = launch(2, "architectures:run", {"names": names, "steps": 1, "lr": LR, "dtype": "float64"})
    return {name: by_rank[0][name] for name in names}


def test_gemma4_sp_adds_no_error_in_float64(results_float64):
    """Settles Gemma 4: in float64 its SP forward equals one device's to rounding (loss within 1e-13), and its update
    is within the fp32 master weights' resolution, as Llama's is (both ~5e-6: a gradient differing in its last float64
    bits rounds to the neighbouring fp32 master weight). What grows over later steps in fp32 is the model amplifying
    rounding, which sdpa against eager on one device shows as much (test above)."""
    for name, result in results_float64.items():
        assert result["error"] is None, result["error"]
        reference = train_plain(name, 1, LR, dtype="float64")
        loss_diff = abs(result["losses"][0] - reference["losses"][0]) / abs(reference["losses"][0])
        update_diff = max(float((result["final"][p] - reference["final"][p]).norm()
                                / (reference["final"][p] - initial).norm())
                          for p, initial in reference["initial"].items()
                          if float((reference["final"][p] - initial).norm()) > 1e-6)
        print(f"[measured] {name} float64, SP=2 vs one device: loss {loss_diff:.1e}, update {update_diff:.1e}")
        assert loss_diff <= 1e-13
        assert update_diff <= 2e-5


def test_modules_calling_a_submodule_per_loop_step_are_found():
    """DBRX's experts (they read ``self.mlp.w1`` and call ``self.mlp`` per expert hit) are found; a Llama, whose
    model reads nothing of a submodule it calls in a loop, has none; a toy with the pattern is found."""
    from lightning_ulysses.models.cross_module_reads import loop_callers_reading_parameters
    from tests.support.architectures import build_model

    found = loop_callers_reading_parameters(build_model("dbrx"))
    assert [type(m).__name__ for m, _ in found] == ["DbrxExperts", "DbrxExperts"]
    assert found[0][1] == "mlp.v1, mlp.w1, mlp.w2"
    assert loop_callers_reading_parameters(build_model("llama")) == []

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def forward(self, x, hits):
            for _ in hits:
                x = self.inner(x) * self.inner.weight.sum()
            return x

    assert [name for _, name in loop_callers_reading_parameters(Toy())] == ["inner.weight"]


def test_the_probe_grows_past_windows_and_chunks_and_names_thresholds_it_does_not_reach():
    """Chunk sizes grow the probe as windows do; Llama 4's `floor_scale` is handled on global positions (not named);
    a length threshold the strategy does not know and the probe does not reach is named (Doge's dynamic-mask
    `keep_window_size` keeps the top 2048 keys, so it sparsifies only past 2048 tokens; Doge itself is refused for
    its learned mask)."""
    from lightning_ulysses.models import form_check
    from tests.support.architectures import build_model

    llama4 = build_model("llama4_text")
    assert form_check.longest_window([llama4]) == llama4.config.attention_chunk_size == 8
    llama4.config.floor_scale = 8192
    assert form_check.unchecked_lengths([llama4], 16) == []
    assert form_check.unchecked_lengths([build_model("doge")], 16) == ["keep_window_size=2048"]
    assert form_check.unchecked_lengths([build_model("mamba2"), build_model("qwen3")], 16) == []


def test_the_form_check_catches_a_model_that_numbers_its_own_positions():
    """RoBERTa-style embeddings number positions from ``padding_idx + 1`` when given none; the strategy numbers the
    positions it fills in the same way. Without that, the check's second probe (contiguous positions, the whole run
    without ``position_ids``, as one device runs a batch that has none) stops the fit before a weight changes."""
    by_rank = launch(2, "architectures:run", {"names": ["roberta"], "steps": 1, "lr": LR,
                                              "mutate": "no_position_numbering"})
    for rank in by_rank:
        assert "FormCheckFailed" in rank["roberta"]["error"], rank["roberta"]["error"]

"""Model forms the strategy is not told about train and evaluate as one device, or stop before a weight changes.

- length-dependent RoPE (dynamic NTK, Phi-3 LongRoPE) chooses its frequencies from the whole batch's largest
  position (packed rows: the longest document), at ZeRO 2 and 3; a static type (yarn) as the control;
- encoders: ModernBERT (local bidirectional windows on global positions, global layers) with `.loss` (labels not
  shifted), BERT (learned positions) with `strategy.cross_entropy` on its labels;
- an own model taking LitGPT's `input_pos` gets global positions;
- the model-form check stops forms without a fix (learned positions from `torch.arange(T)`) and each fix's removal
  (mutations), on every rank, before any weight changes;
- ``trainer.predict/validate/test`` with no fit before give one device's logits and losses (Lightning's DeepSpeed
  inference set-up removes every module hook; the strategy installs its own again).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.forms import ENCODER_FORMS, MaskedTokenDataset, build_form, reference_logits
from tests.support.launcher import launch
from tests.support.models import PackedDataset, TokenDataset, documents_as_rows, lightning_order, sgd_steps
from tests.test_parity import rel_diff, update_rel_diff

STEPS, SEQ_LEN, LR = 4, 32, 0.5
PACKED = [[20, 12], [10, 22], [14, 18], [30, 2]]  # longest documents past 16 positions, shards of 16 at sp=2


def _fit(form: str, stage: int, **options) -> dict:
    return dict(name=f"{form}-zero{stage}" + ("-packed" if options.get("packed") else ""), form=form, stage=stage,
                steps=STEPS, seq_len=SEQ_LEN, num_rows=STEPS, **options)


FORM_RUNS = [_fit(form, stage) for form in ("llama-dynamic", "phi3-longrope") for stage in (2, 3)]
FORM_RUNS += [_fit("llama-yarn", 2), _fit("phi3-longrope", 2, packed=PACKED), _fit("llama-dynamic", 3, packed=PACKED)]
# Encoders: masked LMs with bidirectional attention (ModernBERT's local windows on global positions), unshifted labels.
# BERT's masked-LM head computes its own CrossEntropyLoss (a mean over the shard): its users compute the loss from
# the logits with `strategy.cross_entropy` (exact, below); `.loss` is stopped by the SP-peer loss check (test below).
FORM_RUNS += [_fit("modernbert", 2), _fit("modernbert", 3), dict(_fit("bert", 3), step="logits")]
EVAL_RUNS = [dict(name=f"{form}-zero{stage}", form=form, stage=stage, seq_len=SEQ_LEN, num_rows=2)
             for form, stage in (("phi3-longrope", 2), ("phi3-longrope", 3), ("llama-dynamic", 0))]
EVAL_RUNS.append(dict(EVAL_RUNS[0], name="phi3-longrope-logits-zero2", step="logits"))


@pytest.fixture(scope="module")
def two():
    return launch(2, "combined:run", {"fit": ["model_forms:fit", {"runs": FORM_RUNS}],
                                      "evaluate": ["model_forms:evaluate", {"runs": EVAL_RUNS}]})


def _reference_batches(run: dict) -> list[dict]:
    if run["form"] in ENCODER_FORMS:
        dataset = MaskedTokenDataset(run["num_rows"], run["seq_len"])
        return [{k: v[None] for k, v in dataset[i].items()} for i in lightning_order(len(dataset))[:run["steps"]]]
    if run.get("packed"):
        dataset = PackedDataset(run["packed"])
        return [documents_as_rows(dataset, [i]) for i in lightning_order(len(dataset))[:run["steps"]]]
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    return [{k: v[None] for k, v in dataset[i].items()} for i in lightning_order(len(dataset))[:run["steps"]]]


@pytest.mark.parametrize("run", FORM_RUNS, ids=[r["name"] for r in FORM_RUNS])
def test_model_form_trains_as_one_device(two, run):
    results = [rank["fit"][run["name"]] for rank in two]
    assert all("error" not in r for r in results), results[0].get("error")
    initial = {k: v.detach().clone() for k, v in build_form(run["form"]).named_parameters()}
    reference = sgd_steps(build_form(run["form"]), _reference_batches(run), LR)
    assert results[0]["losses"] == results[1]["losses"]
    assert rel_diff(results[0]["losses"], reference["losses"]) <= 1e-5, (results[0]["losses"], reference["losses"])
    assert update_rel_diff(results[0]["weights"], reference["weights"], initial) <= 1e-4


def _reference_evaluation(run: dict) -> tuple[list, float]:
    model = build_form(run["form"]).eval()
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    with torch.no_grad():
        logits = [reference_logits(model, {k: v[None] for k, v in dataset[i].items()}) for i in range(len(dataset))]
        losses = [model(**{k: v[None] for k, v in dataset[i].items()}).loss.item() for i in range(len(dataset))]
    return logits, sum(losses) / len(losses)


@pytest.mark.parametrize("run", EVAL_RUNS, ids=[r["name"] for r in EVAL_RUNS])
def test_evaluation_outside_fit_is_one_devices(two, run):
    logits, loss = _reference_evaluation(run)
    for rank in two:
        result = rank["evaluate"][run["name"]]
        assert "error" not in result, result["error"]
        assert len(result["predict"]) == len(logits)
        for got, expected in zip(result["predict"], logits):
            assert rel_diff(got, expected) <= 1e-5
        assert result["validate"]["val_loss"] == pytest.approx(loss, rel=1e-5)
        assert result["test"]["test_loss"] == pytest.approx(loss, rel=1e-5)


# The model-form check: forms without a fix are stopped on every rank before the first optimizer step, and every
# fix's removal (a mutation) is caught by it.
OWN_RUNS = [_fit("input-pos", 2), _fit("input-pos", 3)]
# LitGPT's GPT, found without a declaration: three families at ZeRO 2, one at ZeRO 3.
OWN_RUNS += [_fit("litgpt-pythia", 2), _fit("litgpt-llama", 2), _fit("litgpt-gemma", 2), _fit("litgpt-llama", 3)]
STOPPED_RUNS = {
    "learned-positions-zero2": (_fit("learned-positions", 2), "`wpe` (Embedding)"),
    "learned-positions-zero3": (_fit("learned-positions", 3), "`wpe` (Embedding)"),
    "mutation-rope-dynamic": (dict(_fit("llama-dynamic", 2), name="mutation-rope-dynamic", mutation="rope"),
                              "`model.rotary_emb` (LlamaRotaryEmbedding)"),
    "mutation-rope-longrope": (dict(_fit("phi3-longrope", 3), name="mutation-rope-longrope", mutation="rope"),
                               "`model.rotary_emb` (Phi3RotaryEmbedding)"),
    "mutation-input-pos": (dict(_fit("input-pos", 2), name="mutation-input-pos", mutation="input_pos"),
                           "`wpe` (Embedding)"),
    "mutation-litgpt-rope": (dict(_fit("litgpt-llama", 2), name="mutation-litgpt-rope", mutation="litgpt_rope"),
                             "GPT's output"),
    "mutation-encoder-window": (dict(_fit("modernbert", 2), name="mutation-encoder-window",
                                     mutation="encoder_window"), "`model.layers.1.attn."),
}
BERT_OWN_LOSS = dict(_fit("bert", 2), name="bert-own-loss")
REFUSED_CALLS = {
    "num-items": (dict(_fit("llama-yarn", 2), name="num-items", step="num_items"), "ValueError: LlamaForCausalLM was"
                  " given `num_items_in_batch`"),
    "litgpt-chunked-ce": (dict(_fit("litgpt-pythia", 2), name="litgpt-chunked-ce", step="litgpt_chunked"),
                          "SPLossMismatchError"),
    # (a transformers sequence classifier, pooled at the whole sequence's last token, trains exactly:
    # tests/test_post_training.py)
}
STOPPED_EVAL = dict(EVAL_RUNS[0], name="mutation-eval-hooks", mutation="eval_hooks")


@pytest.fixture(scope="module")
def guarded():
    runs = OWN_RUNS + [run for run, _ in STOPPED_RUNS.values()] + [BERT_OWN_LOSS]
    runs += [run for run, _ in REFUSED_CALLS.values()]
    return launch(2, "combined:run", {"fit": ["model_forms:fit", {"runs": runs}],
                                      "evaluate": ["model_forms:evaluate", {"runs": [STOPPED_EVAL]}],
                                      "tuner": ["model_forms:tuner", {}]})


def _own_reference(run: dict) -> dict:
    model = build_form(run["form"])
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _reference_batches(run):
        ids = batch["input_ids"]
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": dict(model.named_parameters()), "initial": initial}


@pytest.mark.parametrize("run", OWN_RUNS, ids=[r["name"] for r in OWN_RUNS])
def test_own_model_with_input_pos_and_litgpt_train_as_one_device(guarded, run):
    results = [rank["fit"][run["name"]] for rank in guarded]
    assert all("error" not in r for r in results), results[0].get("error")
    reference = _own_reference(run)
    assert rel_diff(results[0]["losses"], reference["losses"]) <= 1e-5
    assert update_rel_diff(results[0]["weights"], reference["weights"], reference["initial"]) <= 1e-4
    assert [r["form_checks"] for r in results] == [1, 1]  # the check ran, and passed


@pytest.mark.parametrize("name", list(STOPPED_RUNS))
def test_model_form_check_stops_a_shard_dependent_model_before_any_weight_changes(guarded, name):
    run, module = STOPPED_RUNS[name]
    for rank in guarded:
        result = rank["fit"][run["name"]]
        assert "error" in result, f"{name} trained: {result['losses']}"
        assert result["error"].startswith("FormCheckFailed"), result["error"]
        assert "rank 1:" in result["error"] and module in result["error"], result["error"]
        # no message offers a switch that would then train wrongly
        assert "check_model_form=False" not in result["error"], result["error"]
        assert result["losses"] == [] and result["changed"] == 0.0
        assert result["seconds"] < 60


def test_model_form_check_catches_evaluation_without_the_strategys_hooks(guarded):
    for rank in guarded:
        error = rank["evaluate"][STOPPED_EVAL["name"]].get("error", "")
        assert error.startswith("FormCheckFailed") and "Phi3ForCausalLM" in error, error


def test_model_form_check_ran_once_per_fit(two):
    for rank in two:
        assert all(rank["fit"][run["name"]]["form_checks"] == 1 for run in FORM_RUNS)


def test_a_model_whose_head_averages_its_shard_is_stopped_by_the_loss_check(guarded):
    """BertForMaskedLM computes `CrossEntropyLoss()(logits, labels)` itself: a mean over this rank's tokens."""
    for rank in guarded:
        result = rank["fit"][BERT_OWN_LOSS["name"]]
        assert result.get("error", "").startswith("SPLossMismatchError"), result
        assert result["changed"] == 0.0


def test_lightnings_tuner_is_refused_with_the_alternative(guarded):
    for rank in guarded:
        assert rank["tuner"]["lr_find"].startswith("ValueError: Tuner.lr_find"), rank["tuner"]["lr_find"]
        assert "short fits with different learning rates" in rank["tuner"]["lr_find"]
        assert "not supported" in rank["tuner"]["scale_batch_size"]  # Lightning's own refusal, before any step


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_calls_without_a_one_device_meaning_are_refused(guarded, name):
    """`num_items_in_batch` computed on the shard, LitGPT's own shift and chunked loss."""
    run, start = REFUSED_CALLS[name]
    for rank in guarded:
        result = rank["fit"][run["name"]]
        assert result.get("error", "").startswith(start), result.get("error")
        assert result["changed"] == 0.0


# In-process sweep: every family's rotary embedding with a length-dependent type is recognised, and with the
# whole batch's largest position it gives a shard exactly the rows the whole sequence gets (static types untouched).
def _rope_parameters(kind: str, head_dim: int) -> dict:
    half = head_dim // 2
    return {
        "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
                     "long_factor": [1.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 16},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16},
        "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "default": {"rope_type": "default", "rope_theta": 10000.0},
    }[kind]


ROPE_FAMILIES = ["llama", "qwen2", "mistral", "phi3", "qwen3", "olmo2", "granite", "phimoe"]
ROPE_KINDS = ["dynamic", "longrope", "yarn", "linear", "default"]


def _rotary(family: str, kind: str):
    import importlib

    from transformers import AutoConfig

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_class = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("RotaryEmbedding"))
    extra = {"original_max_position_embeddings": 16} if family in ("phi3", "phimoe") else {}
    params = _rope_parameters(kind, 16)
    if family == "phimoe" and kind == "longrope":  # PhiMoE also scales by an mscale chosen from the length
        params.update(short_mscale=1.0, long_mscale=1.3)
    config = AutoConfig.for_model(family, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=16, rope_parameters=params, **extra)
    return rotary_class, config


@pytest.mark.parametrize("family", ROPE_FAMILIES)
@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rotary_of_every_family_sees_the_whole_batchs_largest_position(family, kind):
    from lightning_ulysses.context import ShardInfo
    from lightning_ulysses.training.step_context import StepContext
    from lightning_ulysses.models.rope import is_length_dependent_rotary, unwrap_rotaries, wrap_length_dependent_rotaries

    try:
        rotary_class, config = _rotary(family, kind)
        whole_module, sharded_module = rotary_class(config), rotary_class(config)
    except Exception as err:  # the family's config does not accept this type
        pytest.skip(f"{family} does not build rope type {kind!r}: {type(err).__name__}")
    length_dependent = kind in ("dynamic", "longrope") or family == "phimoe"
    assert is_length_dependent_rotary(sharded_module) == length_dependent
    x = torch.zeros(1, 1, 16)
    positions = torch.arange(32)[None]  # the whole row: past the 16 positions the short regime covers
    expected = whole_module(x, positions)
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True, shard_info=ShardInfo(32))
    context.shard_info.max_position = 31
    wrapped = wrap_length_dependent_rotaries(sharded_module, context)
    try:
        for shard in (slice(0, 16), slice(16, 32)):  # each SP rank of sp=2, rank 0 first (fresh state)
            got = sharded_module(x, positions[:, shard])
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e[:, shard], rtol=0, atol=1e-6)
    finally:
        unwrap_rotaries(wrapped)
    assert "forward" not in sharded_module.__dict__


# Four processes: length-dependent RoPE with ring attention (zigzag shards: rank 0 holds positions at both ends) and
# with two data-parallel replicas at ZeRO 3 (each replica's probe from its own batch).
FOUR_RUNS = [
    dict(_fit("phi3-longrope", 2), name="phi3-longrope-ring2x2", sp_size=4, strategy={"ring_size": 2}),
    dict(_fit("llama-dynamic", 3), name="llama-dynamic-dp2sp2", sp_size=2, num_rows=2 * STEPS),
]


@pytest.fixture(scope="module")
def four():
    return launch(4, "model_forms:fit", {"runs": FOUR_RUNS})


@pytest.mark.parametrize("run", FOUR_RUNS, ids=[r["name"] for r in FOUR_RUNS])
def test_length_dependent_rope_with_ring_and_data_parallel(four, run):
    results = [rank[run["name"]] for rank in four]
    assert all("error" not in r for r in results), results[0].get("error")
    replicas = 4 // run["sp_size"]
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    order = lightning_order(len(dataset))
    batches = [{k: torch.stack([dataset[i][k] for i in order[step * replicas:(step + 1) * replicas]])
                for k in ("input_ids", "labels")} for step in range(STEPS)]
    initial = {k: v.detach().clone() for k, v in build_form(run["form"]).named_parameters()}
    reference = sgd_steps(build_form(run["form"]), batches, LR)
    losses = torch.tensor([r["losses"] for r in results[::run["sp_size"]]], dtype=torch.float64).mean(0)
    assert rel_diff(losses, reference["losses"]) <= 1e-5, (losses, reference["losses"])
    assert update_rel_diff(results[0]["weights"], reference["weights"], initial) <= 1e-4
    assert all(r["form_checks"] == 1 for r in results)


def test_rope_per_layer_type_is_recognised_and_whole_for_its_length_dependent_layers():
    """Gemma 3 style: one rotary module, a rope type per layer type (dynamic for full attention, default for
    sliding); the full-attention rows are the whole row's, the sliding ones untouched."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from lightning_ulysses.context import ShardInfo
    from lightning_ulysses.training.step_context import StepContext
    from lightning_ulysses.models.rope import is_length_dependent_rotary, unwrap_rotaries, wrap_length_dependent_rotaries

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=16, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"full_attention": _rope_parameters("dynamic", 16),
                                               "sliding_attention": _rope_parameters("default", 16)})
    whole_module, sharded_module = Gemma3RotaryEmbedding(config), Gemma3RotaryEmbedding(config)
    assert is_length_dependent_rotary(sharded_module)
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True, shard_info=ShardInfo(32))
    context.shard_info.max_position = 31
    x, positions = torch.zeros(1, 1, 16), torch.arange(32)[None]
    wrapped = wrap_length_dependent_rotaries(sharded_module, context)
    try:
        for layer_type in ("full_attention", "sliding_attention"):
            expected = whole_module(x, positions, layer_type)
            for shard in (slice(0, 16), slice(16, 32)):
                got = sharded_module(x, positions[:, shard], layer_type)
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e[:, shard], rtol=0, atol=1e-6)
    finally:
        unwrap_rotaries(wrapped)

"""Loss by position and passkey retrieval, exact under sequence parallelism: SP=2 and DP2×SP2 give the single
device's per-bucket curve (plain rows, right padding, packed documents, tiled_loss) and the single device's
teacher-forced passkey scores; the sample builder puts the needle where it was asked to."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses import passkey_sample, run_passkey_grid
from lightning_ulysses.evaluation.retrieval import NEEDLE
from tests.support.launcher import launch
from tests.support.models import build_llama, documents_as_rows, tiny_llama_config
from tests.scenarios.positional import EDGES, CharTokenizer, datasets

REL_TOL = 1e-5
LENGTHS, DEPTHS = [128, 256, 400], [0.0, 0.5, 1.0]


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("passkey")
    results = launch(2, "positional:run", {"sp_size": 2, "passkey_lengths": LENGTHS,
                                                           "passkey_depths": DEPTHS, "output_dir": str(out)})
    return results, out


@pytest.fixture(scope="module")
def dp2_sp2():
    return launch(4, "positional:run", {"sp_size": 2, "passkey_lengths": LENGTHS[:2],
                                                        "passkey_depths": DEPTHS[:2]})


def reference_curve(name: str) -> tuple[list[float], list[float]]:
    """Plain transformers, one process: every target's loss at its position (documents as separate rows)."""
    dataset, collate, _ = datasets()[name]
    model = build_llama(tiny_llama_config()).eval()
    sums, hits, counts = [0.0] * len(EDGES), [0.0] * len(EDGES), [0] * len(EDGES)
    indices = list(range(len(dataset)))
    if name == "packed":
        batch = documents_as_rows(dataset, indices)
    else:
        batch = (collate or torch.utils.data.default_collate)([dataset[i] for i in indices])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits  # [N, L, V]
    labels = batch["labels"][:, 1:]
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    correct = logits[:, :-1].argmax(-1) == labels
    for row in range(labels.shape[0]):
        for position in range(labels.shape[1]):
            if labels[row, position] == -100:
                continue
            bucket = max(i for i, e in enumerate(EDGES) if e <= position)
            sums[bucket] += losses[row, position].item()
            hits[bucket] += float(correct[row, position])
            counts[bucket] += 1
    return ([s / n if n else math.nan for s, n in zip(sums, counts)],
            [h / n if n else math.nan for h, n in zip(hits, counts)])


def assert_curve(got: list[float], want: list[float]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if math.isnan(w):
            assert math.isnan(g)
            continue
        worst = max(worst, abs(g - w) / abs(w))
    assert worst <= REL_TOL, (got, want)
    return worst


@pytest.mark.parametrize("name", ["rows", "padded", "packed", "tiled"])
@pytest.mark.parametrize("layout", ["sp2", "dp2_sp2"])
def test_loss_by_position_is_the_single_device_curve(name, layout, request):
    results = request.getfixturevalue(layout)
    ranks = results[0] if layout == "sp2" else results
    curve, accuracy = reference_curve(name)
    for r in ranks:
        worst = assert_curve(r[name]["curve"], curve)
        assert r[name]["accuracy"] == pytest.approx(accuracy, nan_ok=True)
    print(f"[measured] {layout} {name}: per-bucket relative difference {worst:.1e}")
    logged = ranks[0][name]["logged"]
    assert logged["val_loss_at/0-0"] == pytest.approx(curve[0], rel=REL_TOL)


def reference_passkey(lengths, depths) -> list[dict]:
    from lightning_ulysses.evaluation.retrieval import IGNORE_INDEX

    class Plain:  # a single device: the whole sample, no SP
        sp_size = 1

        def __init__(self) -> None:
            self.model = build_llama(tiny_llama_config()).eval()

        def evaluate_full_batch(self, model, batch):
            with torch.no_grad():
                logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
            return {"loss": loss, "correct": (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX),
                    "shift_labels": labels}

    return run_passkey_grid(Plain(), None, CharTokenizer(), lengths, depths, samples=2, seed=0)


@pytest.mark.parametrize("layout", ["sp2", "dp2_sp2"])
def test_passkey_scores_are_the_single_device_scores(layout, request):
    results = request.getfixturevalue(layout)
    ranks = results[0] if layout == "sp2" else results
    lengths, depths = (LENGTHS, DEPTHS) if layout == "sp2" else (LENGTHS[:2], DEPTHS[:2])
    expected = reference_passkey(lengths, depths)
    for r in ranks:
        assert len(r["passkey"]) == len(expected)
        for got, want in zip(r["passkey"], expected):
            assert (got["length"], got["depth"], got["accuracy"]) == (want["length"], want["depth"], want["accuracy"])
            assert got["log_likelihood"] == pytest.approx(want["log_likelihood"], rel=REL_TOL)
        assert r["passkey_logged"] == pytest.approx(sum(w["accuracy"] for w in expected) / len(expected))


def test_passkey_results_are_written(sp2):
    _, out = sp2
    lines = (out / "passkey.csv").read_text().splitlines()
    assert lines[0] == "length,depth,accuracy,log_likelihood" and len(lines) == 1 + len(LENGTHS) * len(DEPTHS)
    assert (out / "passkey.png").stat().st_size > 1000


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_sample_puts_the_needle_at_the_depth(depth):
    tokenizer = CharTokenizer()
    sample = passkey_sample(tokenizer, 400, depth, key=48151)
    ids = sample["input_ids"].tolist()
    assert len(ids) == 400 and ids[0] == tokenizer.bos_token_id
    text = tokenizer.decode(ids)
    needle = NEEDLE.format(key=48151)
    start = text.index(needle)
    filler_chars = len(text) - len(needle) - len(" What is the pass key? The pass key is 48151") - 1
    assert abs(start / max(1, filler_chars) - depth) < 0.01
    assert text.endswith("What is the pass key? The pass key is 48151")
    labels = sample["labels"]
    assert tokenizer.decode(labels[labels != -100]) == " 48151"

"""Passkey retrieval under sequence parallelism: does the model use the far context?

A sample is filler text with a random passkey sentence inserted at a chosen *depth* (0 = the start of the context,
1 = just before the question), then the question and the answer. The answer tokens are scored teacher-forced
under the SP forward pass, so lengths that need SP can be evaluated exactly: the answer's log-likelihood and whether
every answer token is the argmax. :class:`PasskeyRetrieval` runs a grid of context lengths × depths as a callback at
the end of validation (during ``fit``, or standalone with ``trainer.validate``), logs the mean accuracy and writes
the grid as CSV and a heatmap PNG.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import Callback

from lightning_ulysses.context import IGNORE_INDEX

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


def passkey_sample(tokenizer: Any, length: int, depth: float, key: int) -> dict[str, Any]:
    """One sample of exactly ``length`` tokens: ``[bos] filler[:a] needle filler[a:] question answer``, with
    ``a = round(depth × filler tokens)``. ``labels`` are ``-100`` except on the answer (`` {key}``) tokens.

    Returns ``{"input_ids": [length], "labels": [length], "needle_start": token index, "answer_start": index}``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    needle, question, answer = ids(NEEDLE.format(key=key)), ids(QUESTION), ids(f" {key}")
    filler_len = length - len(bos) - len(needle) - len(question) - len(answer)
    if filler_len < 0:
        raise ValueError(f"A passkey sample needs at least {length - filler_len} tokens with this tokenizer; got"
                         f" length={length}.")
    unit = ids(FILLER)
    filler = (unit * (filler_len // max(1, len(unit)) + 1))[:filler_len]
    cut = round(depth * filler_len)
    tokens = bos + filler[:cut] + needle + filler[cut:] + question + answer
    labels = [IGNORE_INDEX] * (len(tokens) - len(answer)) + answer
    return {"input_ids": torch.tensor(tokens), "labels": torch.tensor(labels),
            "needle_start": len(bos) + cut, "answer_start": len(tokens) - len(answer)}


def score_passkey(strategy: Any, model: Any, sample: dict[str, Any]) -> dict[str, float]:
    """Teacher-forced score of one sample under the strategy (every rank calls it with the same sample):
    ``{"log_likelihood": sum of the answer tokens' log-probabilities, "exact": 1.0 if every answer token is the
    argmax else 0.0}``, the same on every rank."""
    batch = {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]}
    stats = strategy.evaluate_full_batch(model, batch)
    answer = stats["shift_labels"] != IGNORE_INDEX  # [1, s]: this rank's answer targets
    # [3]: -log-likelihood, correct answer tokens, answer tokens of this shard; summed over the SP group.
    totals = torch.stack([stats["loss"][answer].sum().double(), stats["correct"][answer].sum().double(),
                          answer.sum().double()])
    if strategy.sp_size > 1:
        torch.distributed.all_reduce(totals, group=strategy.sp_group)
    nll, correct, tokens = totals.tolist()
    return {"log_likelihood": -nll, "exact": float(correct == tokens and tokens > 0)}


class PasskeyRetrieval(Callback):
    """Passkey retrieval over ``lengths × depths`` at the end of every validation (``fit``, ``trainer.validate``).

    Args:
        tokenizer: the model's tokenizer (builds the samples).
        lengths: context lengths in tokens (each must fit the model; any multiple of nothing: the strategy pads).
        depths: needle depths in ``[0, 1]``.
        samples: samples per cell (different random keys).
        output_dir: where rank 0 writes ``passkey.csv`` and ``passkey.png`` (``None``: nothing written).
        every_n_validations: run at every n-th validation (the sanity check does not count).
        seed: seed of the keys (the same grid every time).

    Logs ``passkey_accuracy`` (mean over the grid) and ``passkey_log_likelihood``; ``self.results`` holds the last
    grid as a list of ``{"length", "depth", "accuracy", "log_likelihood"}``.
    """

    def __init__(self, tokenizer: Any, lengths: Sequence[int], depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                 samples: int = 1, output_dir: Optional[str] = None, every_n_validations: int = 1,
                 seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.lengths, self.depths = list(lengths), list(depths)
        self.samples, self.seed = samples, seed
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.every_n_validations = every_n_validations
        self.results: list[dict[str, float]] = []
        self._validations = 0

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_validations:
            return
        strategy = trainer.strategy
        models = getattr(strategy, "prepared_models", [])
        if not models:
            raise RuntimeError("PasskeyRetrieval needs UlyssesDeepSpeedStrategy with a Hugging Face model.")
        self.results = run_passkey_grid(strategy, models[0], self.tokenizer, self.lengths, self.depths,
                                        self.samples, self.seed)
        accuracy = sum(r["accuracy"] for r in self.results) / len(self.results)
        log_likelihood = sum(r["log_likelihood"] for r in self.results) / len(self.results)
        pl_module.log("passkey_accuracy", accuracy, rank_zero_only=True)
        pl_module.log("passkey_log_likelihood", log_likelihood, rank_zero_only=True)
        if self.output_dir is not None and trainer.is_global_zero:
            write_passkey_results(self.results, self.output_dir)


def run_passkey_grid(strategy: Any, model: Any, tokenizer: Any, lengths: Sequence[int], depths: Sequence[float],
                     samples: int = 1, seed: int = 0) -> list[dict[str, float]]:
    """Score the grid (every rank calls it identically); mean accuracy and log-likelihood per cell."""
    rng = random.Random(seed)
    keys = {(length, depth, i): rng.randint(10000, 99999) for length in lengths for depth in depths
            for i in range(samples)}
    results = []
    for length in lengths:
        for depth in depths:
            scores = [score_passkey(strategy, model, passkey_sample(tokenizer, length, depth, keys[length, depth, i]))
                      for i in range(samples)]
            results.append({"length": length, "depth": depth,
                            "accuracy": sum(s["exact"] for s in scores) / samples,
                            "log_likelihood": sum(s["log_likelihood"] for s in scores) / samples})
    return results


def write_passkey_results(results: list[dict[str, float]], output_dir: Path) -> None:
    """``passkey.csv`` and a ``passkey.png`` heatmap (length × depth, colour = accuracy, text = log-likelihood)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "passkey.csv", "w") as f:
        f.write("length,depth,accuracy,log_likelihood\n")
        for r in results:
            f.write(f"{r['length']},{r['depth']},{r['accuracy']:.4f},{r['log_likelihood']:.4f}\n")
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in results})
    depths = sorted({r["depth"] for r in results})
    cell = {(r["depth"], r["length"]): r for r in results}
    grid = [[cell[d, n]["accuracy"] for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            ax.text(j, i, f"{cell[d, n]['log_likelihood']:.1f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("passkey retrieval: accuracy (colour), answer log-likelihood (text)")
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    fig.tight_layout()
    fig.savefig(output_dir / "passkey.png", dpi=120)
    plt.close(fig)

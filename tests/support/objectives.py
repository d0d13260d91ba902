"""Post-training objectives written once, run two ways: on one device over whole rows (plain PyTorch, the reference),
and under SP through the strategy's sequence-level API (what a user writes in ``training_step``).

Each objective takes ``ops`` (:class:`OneDevice` or :class:`SequenceParallel`: where the per-token values come from
and how they are reduced), the module holding the models (``policy``, ``ref``, ``teacher``, ``value_head``) and the
batch. The formulas are TRL's (DPO/IPO sigmoid and IPO losses, SimPO, KTO's unpaired loss with the batch KL
estimate, GRPO's clipped surrogate with the k3 KL estimate) and the usual reward, distillation and InfoNCE losses.

Batches: ``2B`` rows (chosen rows first, then rejected; or queries then documents), right-padded, prompts masked
(``labels = -100``), plus per-row ``advantages`` / ``desirable`` ``[2B]`` and per-position ``old_logps`` ``[2B, S]``
(``old_logps[b, i]``: the log-probability of token ``i + 1``, aligned with the targets).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BETA = 0.5
# SGD step sizes per objective (default 0.2): the squared losses diverge at 0.2
LEARNING_RATES = {"ipo": 0.01, "classifier_own_loss": 0.01}


class _ModelCalls:
    """The model calls both ways share (the shard, or the whole rows)."""

    def hidden(self, model, batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     output_hidden_states=True).hidden_states[-1]

    def backbone_hidden(self, model, batch):
        """The backbone called directly (``model.model``), as for an extra head."""
        return model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state


class OneDevice(_ModelCalls):
    """Whole rows on one device: per-token values at positions ``0..S-2`` against ``labels[:, 1:]``."""

    def logits_and_targets(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        return logits, batch["labels"][:, 1:]

    def aligned(self, batch, key):
        return batch[key][:, :-1]

    def sequence_sum(self, values, mask):
        return (values * mask).sum(1)

    def sequence_mean(self, values, mask):
        return (values * mask).sum(1) / mask.sum(1)

    def token_mean(self, values, mask):
        return (values * mask).sum() / mask.sum()

    def sequence_count(self, mask):
        return mask.sum(1)

    def last_token(self, hidden, batch):
        last = batch["attention_mask"].sum(1) - 1
        return hidden[torch.arange(hidden.shape[0]), last]

    def mean_pool(self, hidden, batch):
        mask = batch["attention_mask"][..., None].to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)

    def whole_rows(self, values, batch):
        return values, batch["attention_mask"]

    whole_rows_public = whole_rows


class SequenceParallel(_ModelCalls):
    """This rank's shard, reduced with the strategy's API (``strategy``: the Trainer's or Fabric's)."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def logits_and_targets(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits, batch["shift_labels"]

    def aligned(self, batch, key):
        return batch[key]

    def sequence_sum(self, values, mask):
        return self.strategy.sequence_sum(values, mask)

    def sequence_mean(self, values, mask):
        return self.strategy.sequence_mean(values, mask)

    def token_mean(self, values, mask):
        return self.strategy.token_mean(values, mask=mask)

    def sequence_count(self, mask):
        return self.strategy.sequence_count(mask)

    def last_token(self, hidden, batch):
        return self.strategy.last_token(hidden)

    def mean_pool(self, hidden, batch):
        return self.strategy.sequence_mean(hidden, batch["attention_mask"].bool())

    def whole_rows(self, values, batch):
        """The whole rows on every rank (differentiable), with their padding mask."""
        return self.strategy.gather_sequence(values), self.strategy.gather_sequence(batch["attention_mask"])

    def whole_rows_public(self, values, batch):
        """The same with the package-level ``lightning_ulysses.gather_sequence(tensor, group, seq_len)``."""
        from lightning_ulysses import gather_sequence

        seq_len = self.strategy.current_shard_info.seq_len
        return (gather_sequence(values, self.strategy.sp_group, seq_len),
                gather_sequence(batch["attention_mask"], self.strategy.sp_group, seq_len))


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log-probabilities of the targets and ``[B, T]`` float mask of the positions that have one."""
    mask = targets != -100
    logps = torch.gather(logits.float().log_softmax(-1), -1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return logps, mask.float()


def _policy_and_reference(ops, module, batch):
    logits, targets = ops.logits_and_targets(module.policy, batch)
    policy, mask = token_logps(logits, targets)
    with torch.no_grad():
        ref_logits, _ = ops.logits_and_targets(module.ref, batch)
        reference, _ = token_logps(ref_logits, targets)
    return policy, reference, mask


def token_logps_in_model_dtype(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``selective_log_softmax`` for bf16/fp16 logits (per-row ``logsumexp`` in the logits' dtype, no float32
    copy of the logits): ``[B, T]`` log-probabilities in the logits' dtype and the ``[B, T]`` mask."""
    mask = targets != -100
    picked = torch.gather(logits, -1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1), mask.to(logits.dtype)


def dpo_logps_in_model_dtype(ops, module, batch):
    """DPO on log-probabilities kept in the model's dtype (bf16 under bf16 training), summed per row: what a user who
    copies TRL's bf16 path reduces with ``strategy.sequence_sum``."""
    logits, targets = ops.logits_and_targets(module.policy, batch)
    policy, mask = token_logps_in_model_dtype(logits, targets)
    with torch.no_grad():
        reference, _ = token_logps_in_model_dtype(ops.logits_and_targets(module.ref, batch)[0], targets)
    chosen, rejected = _halves(ops.sequence_sum(policy, mask) - ops.sequence_sum(reference, mask))
    return -F.logsigmoid(BETA * (chosen - rejected)).mean()


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0] // 2
    return x[:n], x[n:]


def dpo(ops, module, batch, ipo: bool = False):
    policy, reference, mask = _policy_and_reference(ops, module, batch)
    ratios = ops.sequence_sum(policy, mask) - ops.sequence_sum(reference, mask)  # [2B]
    chosen, rejected = _halves(ratios)
    logits = chosen - rejected
    if ipo:
        return ((logits - 1 / (2 * BETA)) ** 2).mean()
    return -F.logsigmoid(BETA * logits).mean()


def simpo(ops, module, batch, gamma: float = 0.3):
    logits, targets = ops.logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    chosen, rejected = _halves(ops.sequence_mean(logps, mask))  # length-normalised
    return -F.logsigmoid(2.0 * (chosen - rejected) - gamma).mean()


def kto(ops, module, batch):
    policy, reference, mask = _policy_and_reference(ops, module, batch)
    ratios = ops.sequence_sum(policy, mask) - ops.sequence_sum(reference, mask)  # [2B]
    kl = ratios.mean().clamp(min=0).detach()  # the batch's KL estimate (TRL's mismatched-pair estimate simplified)
    desirable = batch["desirable"].bool()
    losses = torch.where(desirable, 1 - torch.sigmoid(BETA * (ratios - kl)), 1 - torch.sigmoid(BETA * (kl - ratios)))
    return losses.mean()


def distill(ops, module, batch, temperature: float = 2.0):
    logits, targets = ops.logits_and_targets(module.policy, batch)
    with torch.no_grad():
        teacher_logits, _ = ops.logits_and_targets(module.teacher, batch)
    student = (logits.float() / temperature).log_softmax(-1)
    teacher = (teacher_logits.float() / temperature).log_softmax(-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # [B, T] token KL(teacher || student)
    mask = (targets != -100).float()
    return ops.token_mean(kl, mask) * temperature ** 2


def reward(ops, module, batch):
    hidden = ops.backbone_hidden(module.policy, batch)
    scores = module.value_head(ops.last_token(hidden, batch).float()).squeeze(-1)  # [2B]
    chosen, rejected = _halves(scores)
    return -F.logsigmoid(chosen - rejected).mean()


def embedding(ops, module, batch, pooling: str = "mean", temperature: float = 0.1):
    hidden = ops.hidden(module.policy, batch).float()
    pooled = ops.mean_pool(hidden, batch) if pooling == "mean" else ops.last_token(hidden, batch)
    queries, documents = _halves(F.normalize(pooled, dim=-1))
    scores = queries @ documents.T / temperature  # [B, B] in-batch negatives
    return F.cross_entropy(scores, torch.arange(scores.shape[0]))


def classifier_pairs(ops, module, batch):
    """A reward model built as ``AutoModelForSequenceClassification``: Bradley-Terry on its pooled scores."""
    scores = module.classifier(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    chosen, rejected = _halves(scores)
    return -F.logsigmoid(chosen - rejected).mean()


def classifier_own_loss(ops, module, batch):
    """The classifier's own ``.loss`` (one label: regression on the per-row ``advantages``)."""
    return module.classifier(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["advantages"]).loss


def embedding_gathered(ops, module, batch, temperature: float = 0.1, public: bool = False):
    """Mean pooling over the whole rows, gathered (the differentiable ``gather_sequence``)."""
    gather = ops.whole_rows_public if public else ops.whole_rows
    hidden, mask = gather(ops.hidden(module.policy, batch).float(), batch)
    mask = mask[..., None].to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    queries, documents = _halves(F.normalize(pooled, dim=-1))
    return F.cross_entropy(queries @ documents.T / temperature, torch.arange(queries.shape[0]))


def grpo(ops, module, batch, normalise: str = "sequence", clip: float = 0.2, kl_beta: float = 0.05):
    policy, reference, mask = _policy_and_reference(ops, module, batch)
    old = ops.aligned(batch, "old_logps")
    ratio = torch.exp(policy - old)
    advantages = batch["advantages"][:, None]
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    kl = torch.exp(reference - policy) - (reference - policy) - 1  # k3 estimator
    per_token = -(surrogate - kl_beta * kl)
    if normalise == "sequence":  # GRPO: each completion's mean, then the mean over completions
        return ops.sequence_mean(per_token, mask).mean()
    return ops.token_mean(per_token, mask)  # DAPO / token-level normalisation


def grpo_row_weights(ops, module, batch):
    """GRPO's surrogate (on-policy, unclipped) with each completion's mean written as a sum with row weights:
    ``sum_t ratio · mask · adv / count`` per row, the count of the whole row's targets (``strategy.sequence_count``)."""
    logits, targets = ops.logits_and_targets(module.policy, batch)
    policy, mask = token_logps(logits, targets)
    ratio = torch.exp(policy - ops.aligned(batch, "old_logps"))  # [B, T]
    weights = mask * (batch["advantages"] / ops.sequence_count(mask).clamp(min=1))[:, None]  # [B, T] row-constant
    return -ops.sequence_sum(ratio, weights).mean()


OBJECTIVES = {
    "dpo": dpo,
    "ipo": lambda ops, m, b: dpo(ops, m, b, ipo=True),
    "simpo": simpo,
    "kto": kto,
    "distill": distill,
    "reward": reward,
    "embedding_mean": lambda ops, m, b: embedding(ops, m, b, "mean"),
    "embedding_last": lambda ops, m, b: embedding(ops, m, b, "last"),
    "embedding_gathered": embedding_gathered,
    "embedding_gathered_public": lambda ops, m, b: embedding_gathered(ops, m, b, public=True),
    "classifier_pairs": classifier_pairs,
    "classifier_own_loss": classifier_own_loss,
    "grpo_sequence": lambda ops, m, b: grpo(ops, m, b, "sequence"),
    "grpo_token": lambda ops, m, b: grpo(ops, m, b, "token"),
    "grpo_row_weights": grpo_row_weights,
}


# ---------------------------------------------------------------------------------------------- written for one device
def trl_batch_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """TRL's ``get_batch_logps`` as users copy it: own shift, per-row sum (or mean) over the row's targets."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1]
    mask = labels != -100
    labels[~mask] = 0
    logps = torch.gather(logits.float().log_softmax(-1), 2, labels[..., None]).squeeze(2)
    return (logps * mask).sum(-1) / mask.sum(-1) if average else (logps * mask).sum(-1)


def dpo_one_device_code(module, batch):
    """DPO the one-device way, pasted into ``training_step``: TRL's ``get_batch_logps`` on the shard."""
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        ref_logits = module.ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ratios = trl_batch_logps(logits, batch["labels"]) - trl_batch_logps(ref_logits, batch["labels"])
    chosen, rejected = _halves(ratios)
    return -F.logsigmoid(BETA * (chosen - rejected)).mean()


def simpo_one_device_code(module, batch):
    """SimPO the one-device way: per-row means over the shard's targets (NaN where a row has none here)."""
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    chosen, rejected = _halves(trl_batch_logps(logits, batch["labels"], average=True))
    return -F.logsigmoid(2.0 * (chosen - rejected) - 0.3).mean()


def nan_everywhere(module, batch):
    """A per-row mean over no position (0 / 0 on every row): NaN on every rank, as it would be on one device."""
    strategy = module.trainer.strategy
    logits, targets = SequenceParallel(strategy).logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    return strategy.sequence_mean(logps, torch.zeros_like(mask, dtype=torch.bool)).mean()


def inf_everywhere(module, batch):
    """A proper sequence-level loss plus +inf: inf on every rank (as on one device), with finite gradients, which
    DeepSpeed would apply. (The check once turned +inf into the largest float and took it for agreement.)"""
    strategy = module.trainer.strategy
    logits, targets = SequenceParallel(strategy).logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    return -strategy.sequence_mean(logps, mask).mean() + float("inf")


def row_weight_from_shard(module, batch):
    """Per-sample weights from the shard's target counts (SFT averaged per sample, the one-device way)."""
    strategy = module.trainer.strategy
    logits, targets = SequenceParallel(strategy).logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    counts = (batch["shift_labels"] != -100).sum(1).clamp(min=1)  # this rank's count of each row's targets
    return strategy.token_mean(-logps, weights=1.0 / counts)


def token_weight_from_shard(module, batch):
    """The same per-sample weights from the shard's counts, broadcast over the tokens as ``[B, s]`` weights (zero where
    there is no target): one value per row on each rank, a different one on each rank."""
    strategy = module.trainer.strategy
    logits, targets = SequenceParallel(strategy).logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    counts = (batch["shift_labels"] != -100).sum(1).clamp(min=1)
    return strategy.token_mean(-logps, weights=mask.float() / counts[:, None])


def grpo_local_count(module, batch):
    """:func:`grpo_row_weights` with the one-device count, ``mask.sum(1)``, which on the shard counts this rank's
    targets of each row: row-constant weights, a different constant on each rank (issue 61)."""
    strategy = module.trainer.strategy
    logits, targets = SequenceParallel(strategy).logits_and_targets(module.policy, batch)
    logps, mask = token_logps(logits, targets)
    ratio = torch.exp(logps - batch["old_logps"])
    local_count = mask.sum(1).clamp(min=1)  # [B]: this rank's targets of each row
    return -strategy.sequence_sum(ratio, mask * (batch["advantages"] / local_count)[:, None]).mean()


# Objectives run only where precision is compared (tests/test_bf16.py), not in the fp32 parity matrix.
PRECISION_OBJECTIVES = {"dpo_logps_in_model_dtype": dpo_logps_in_model_dtype}
ONE_DEVICE_CODE = {"dpo_one_device_code": dpo_one_device_code, "simpo_one_device_code": simpo_one_device_code,
                   "nan_everywhere": nan_everywhere, "row_weight_from_shard": row_weight_from_shard,
                   "inf_everywhere": inf_everywhere, "token_weight_from_shard": token_weight_from_shard,
                   "grpo_local_count": grpo_local_count}


# ---------------------------------------------------------------------------------------------- data and models
def preference_rows(num_pairs: int = 8, seed: int = 3, vocab: int = 128, max_len: int = 16) -> list[dict]:
    """Pairs of sequences sharing a prompt (3-6 tokens), of 9-16 tokens in all; with per-row advantages and old
    log-probabilities for the GRPO objectives."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(num_pairs):
        prompt = int(torch.randint(3, 7, (1,), generator=g))
        rows = []
        for _ in range(2):
            n = int(torch.randint(9, max_len + 1, (1,), generator=g))
            ids = torch.randint(1, vocab, (n,), generator=g)
            rows.append({"input_ids": ids, "prompt": prompt,
                         "old_logps": -4.85 + 0.3 * torch.randn(n, generator=g),
                         "advantage": float(torch.randn(1, generator=g))})
        pairs.append(rows)
    return pairs


def collate_pairs(pairs: list[list[dict]]) -> dict[str, torch.Tensor]:
    """``2B`` right-padded rows: the first of every pair, then the second; prompt and padding labelled -100."""
    rows = [pair[0] for pair in pairs] + [pair[1] for pair in pairs]
    longest = max(len(r["input_ids"]) for r in rows)
    n = len(rows)
    batch = {"input_ids": torch.zeros(n, longest, dtype=torch.long),
             "labels": torch.full((n, longest), -100, dtype=torch.long),
             "attention_mask": torch.zeros(n, longest, dtype=torch.long),
             "old_logps": torch.zeros(n, longest),
             "advantages": torch.tensor([r["advantage"] for r in rows]),
             "desirable": torch.tensor([1.0] * len(pairs) + [0.0] * len(pairs))}
    for i, r in enumerate(rows):
        length = len(r["input_ids"])
        batch["input_ids"][i, :length] = r["input_ids"]
        batch["labels"][i, r["prompt"]:length] = r["input_ids"][r["prompt"]:]
        batch["attention_mask"][i, :length] = 1
        batch["old_logps"][i, :length - 1] = r["old_logps"][1:]  # position i: the old log-prob of token i + 1
    return batch


def build_models(seed: int = 0, classifier: bool = False) -> dict[str, torch.nn.Module]:
    """The policy, its frozen reference (the same initial weights), a frozen teacher of another width and a value
    head; with ``classifier``, also a reward model built as ``AutoModelForSequenceClassification`` (one label)."""
    from transformers import AutoModelForSequenceClassification

    from tests.support.models import build_llama, tiny_llama_config

    policy = build_llama(tiny_llama_config(), seed)
    ref = build_llama(tiny_llama_config(), seed).requires_grad_(False).eval()
    teacher = build_llama(tiny_llama_config(num_heads=2, num_kv_heads=2), seed + 1).requires_grad_(False).eval()
    torch.manual_seed(seed + 2)
    value_head = torch.nn.Linear(policy.config.hidden_size, 1)
    models = {"policy": policy, "ref": ref, "teacher": teacher, "value_head": value_head}
    if classifier:
        config = tiny_llama_config()
        config.num_labels = 1
        torch.manual_seed(seed + 3)
        models["classifier"] = AutoModelForSequenceClassification.from_config(config)
    return models


def trainable(module) -> list[torch.nn.Parameter]:
    extra = list(module.classifier.parameters()) if hasattr(module, "classifier") else []
    return [*module.policy.parameters(), *module.value_head.parameters(), *extra]


def trained_weights(module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters by name (what the parity tests compare)."""
    return {name: p for name, p in module.named_parameters() if name.startswith(("policy.", "value_head.",
                                                                                   "classifier."))}

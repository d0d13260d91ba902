"""Model forms a user brings that the strategy must handle without being told: length-dependent RoPE (dynamic NTK,
LongRoPE), own models with learned absolute positions or ``input_pos``, encoders. Each form is built by name, the
same in the worker processes and in the single-device reference."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader

from tests.support.models import VOCAB

HEAD_DIM = 16
# Rows of 32 tokens; the RoPE forms switch behaviour past 16 positions, so a shard of 16 (sp=2) sees the short
# regime while the whole row is in the long one.
SHORT_CONTEXT = 16


def _llama(rope_parameters: dict, max_positions: int, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         rope_parameters=rope_parameters, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _phi3_longrope(seed: int) -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    half = HEAD_DIM // 2
    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SHORT_CONTEXT,
                        original_max_position_embeddings=SHORT_CONTEXT, pad_token_id=0, eos_token_id=1,
                        bos_token_id=1, attn_implementation="sdpa",
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                         "long_factor": [1.0 + 0.5 * i for i in range(half)],
                                         "original_max_position_embeddings": SHORT_CONTEXT})
    torch.manual_seed(seed)
    return Phi3ForCausalLM(config)


def _modernbert(seed: int, **options) -> nn.Module:
    """ModernBERT masked LM: local (bidirectional window of ±4 tokens) and global layers."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
                              attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2, mask_token_id=MASK_TOKEN, **options)
    torch.manual_seed(seed)
    return ModernBertForMaskedLM(config)


def _bert(seed: int) -> nn.Module:
    """BERT masked LM (learned absolute positions, bidirectional attention through transformers' interface)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def _llama_classifier(seed: int) -> nn.Module:
    """A sequence classifier: one output per row (the last token's), not per token."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, attn_implementation="sdpa",
                         pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


MASK_TOKEN = 3


class MaskedTokenDataset(torch.utils.data.Dataset):
    """Masked-LM rows: every third token replaced by the mask token, labels only there (-100 elsewhere)."""

    def __init__(self, num_rows: int, seq_len: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        original = torch.randint(4, VOCAB, (num_rows, seq_len), generator=g)
        chosen = torch.zeros(num_rows, seq_len, dtype=torch.bool)
        chosen[:, 1::3] = True
        self.rows = torch.where(chosen, torch.full_like(original, MASK_TOKEN), original)
        self.labels = torch.where(chosen, original, torch.full_like(original, -100))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


class LearnedPositionGPT(nn.Module):
    """A nanoGPT-style model of a user's own: learned absolute positions ``wpe(torch.arange(T))``, an attention
    core the user declares (``attention_modules=[SDPACore]``)."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(max_len, n_embd)
        self.blocks = nn.ModuleList(SelfAttentionBlock(n_embd, n_head) for _ in range(n_layer))
        self.head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # local length under SP: the bug
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SDPACore(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B, H, S, D]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SelfAttentionBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv, self.proj, self.core = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd), SDPACore()
        self.norm = nn.LayerNorm(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, C)
        return x + self.proj(y)


class InputPosGPT(LearnedPositionGPT):
    """An own model whose forward takes LitGPT's ``input_pos`` (optional; ``arange(T)`` when left out)."""

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if input_pos is None:
            input_pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(input_pos)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


HF_FORMS = {
    "llama-dynamic": lambda seed: _llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                         SHORT_CONTEXT, seed),
    "llama-yarn": lambda seed: _llama({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": SHORT_CONTEXT}, 4 * SHORT_CONTEXT, seed),
    "phi3-longrope": _phi3_longrope,
    "modernbert": _modernbert,
    "bert": _bert,
    "llama-classifier": lambda seed: _llama_classifier(seed),
}
ENCODER_FORMS = ("modernbert", "bert")
OWN_FORMS = {"learned-positions": LearnedPositionGPT, "input-pos": InputPosGPT}


def _litgpt(name: str, **overrides) -> Any:
    """LitGPT's ``GPT`` from one of its named configs, shrunk (nothing downloaded)."""
    def build(seed: int) -> nn.Module:
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config.from_name(name, n_layer=2, n_embd=64, n_head=4, head_size=16, block_size=64,
                                  vocab_size=VOCAB, padded_vocab_size=VOCAB, **overrides)
        torch.manual_seed(seed)
        model = GPT(config)
        model.apply(model._init_weights)
        return model

    return build


# Three families: GPT-NeoX (parallel residual, partial rotary), Llama (GQA), Gemma (MQA, scaled embeddings).
LITGPT_FORMS = {
    "litgpt-pythia": _litgpt("pythia-14m"),
    "litgpt-llama": _litgpt("tiny-llama-1.1b", n_query_groups=2, intermediate_size=96),
    "litgpt-gemma": _litgpt("gemma-2b", n_query_groups=1, intermediate_size=96),
}


def build_form(name: str, seed: int = 0) -> nn.Module:
    if name in HF_FORMS:
        return HF_FORMS[name](seed)
    if name in LITGPT_FORMS:
        return LITGPT_FORMS[name](seed)
    torch.manual_seed(seed)
    return OWN_FORMS[name]()


class FormModule(LightningModule):
    """The LightningModule a user writes around a form: ``self.model(**batch).loss`` for Hugging Face models,
    logits + ``strategy.cross_entropy`` for own models (``step="logits"`` for HF models too)."""

    def __init__(self, form: str, dataset, lr: float = 0.5, batch_size: int = 1, collate_fn=None,
                 step: str = "auto") -> None:
        super().__init__()
        self.model = build_form(form)
        self.hf = form in HF_FORMS
        self.step = "loss" if step == "auto" and self.hf else ("logits" if step == "auto" else step)
        self.lr, self.dataset, self.batch_size, self.collate_fn = lr, dataset, batch_size, collate_fn

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.step == "loss":
            return self.model(**batch).loss
        if self.step == "num_items":  # a user's own normaliser, computed in the step (on the shard under SP)
            return self.model(**batch, num_items_in_batch=(batch["labels"] != -100).sum()).loss
        if self.step == "litgpt_chunked":  # LitGPT's pretraining recipe: its own shift and chunked loss
            from litgpt.utils import chunked_cross_entropy

            logits = self.model(batch["input_ids"])
            return chunked_cross_entropy(logits[..., :-1, :], batch["input_ids"][..., 1:])
        if self.step == "classify":
            logits = self.model(input_ids=batch["input_ids"]).logits  # [B, num_labels]
            return F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device))
        logits = self.model(input_ids=batch["input_ids"]).logits if self.hf else self.model(batch["input_ids"])
        # a masked LM's targets are its labels where they are; a causal LM's the next tokens (the collate step's)
        targets = batch["labels"] if getattr(self.model, "loss_type", None) == "ForMaskedLM" else batch["shift_labels"]
        return self.trainer.strategy.cross_entropy(logits, targets)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        if self.hf:
            return self.model(input_ids=batch["input_ids"]).logits
        return self.model(batch["input_ids"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def _loader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def reference_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One device's logits of a full batch for any form."""
    if isinstance(model, (LearnedPositionGPT,)):
        return model(batch["input_ids"])
    return model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}).logits

"""What one rank keeps during a training step, counted by live tensor bytes (TensorMemoryMonitor), for the
issue model's shape (a Llama with 8 heads and a small vocabulary, where no logits hide the rest)."""

from __future__ import annotations

import gc

import torch
from lightning.pytorch import Callback, LightningModule
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses import TensorMemoryMonitor, UlyssesDeepSpeedStrategy
from tests.support.training import make_trainer


def run(payload: dict) -> dict:
    """One fit, or with ``payload["runs"]`` several (one launch): their results in order."""
    if "runs" in payload:
        return {"runs": [_fit(run) for run in payload["runs"]]}
    return _fit(payload)


def _fit(payload: dict) -> dict:
    sp, seq_len, hidden = payload["sp"], payload["seq_len"], payload["hidden"]
    losses: list[float] = []

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            if payload.get("moe") or payload.get("hybrid"):
                from transformers import AutoModelForCausalLM

                config = hybrid_config(payload) if payload.get("hybrid") else moe_config(payload)
                self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            else:
                self.model = LlamaForCausalLM(LlamaConfig(
                    vocab_size=payload["vocab"], hidden_size=hidden, intermediate_size=4 * hidden,
                    num_hidden_layers=payload["layers"], num_attention_heads=8,
                    num_key_value_heads=payload.get("kv_heads", 8), max_position_embeddings=seq_len,
                    attn_implementation="sdpa", pad_token_id=0))

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(1, payload["vocab"], (payload["steps"], seq_len), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    persistent: list[int] = []
    before = _live_tensor_bytes()  # what an earlier fit in this process still holds

    class Persistent(Callback):
        """The live tensor bytes this fit added as its last step begins (the model's states, DeepSpeed's buffers,
        the batch): what a step starts from."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == payload["steps"] - 1:
                persistent.append(_live_tensor_bytes() - before)

    monitor = TensorMemoryMonitor()
    strategy = UlyssesDeepSpeedStrategy(sp_size=sp, stage=payload["stage"], reduce_bucket_size=payload["bucket"],
                                        allgather_bucket_size=payload["bucket"], ring_size=payload.get("ring", 1))
    if "persistence" in payload:
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = payload["persistence"]
    make_trainer(strategy, payload["steps"], callbacks=[Persistent(), monitor],
                 precision=payload.get("precision", "32-true")).fit(
        Module(), torch.utils.data.DataLoader(data, batch_size=1))
    last = monitor.steps[-1]
    return {"peak": last.peak_bytes, "by_layer": last.by_layer, "by_kind": last.by_kind, "losses": losses,
            "persistent": persistent[-1]}


def moe_config(payload: dict):
    """A Qwen3-MoE of the payload's width: 8 experts of a quarter of the dense MLP's width, 2 picked per token,
    transformers' fused experts."""
    from transformers import Qwen3MoeConfig

    hidden = payload["hidden"]
    return Qwen3MoeConfig(vocab_size=payload["vocab"], hidden_size=hidden, intermediate_size=4 * hidden,
                          moe_intermediate_size=hidden, num_hidden_layers=payload["layers"], num_attention_heads=8,
                          num_key_value_heads=8, head_dim=hidden // 8, num_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=payload["seq_len"], pad_token_id=0)


def hybrid_config(payload: dict):
    """A Qwen3-Next of the payload's width (gated delta net layers and full attention layers, 3 : 1, fused experts):
    4 layers, 8 heads of 32 for both kinds."""
    from transformers import AutoConfig

    hidden = payload["hidden"]
    return AutoConfig.for_model(
        "qwen3_next", vocab_size=payload["vocab"], hidden_size=hidden, intermediate_size=4 * hidden,
        moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8, linear_num_key_heads=8,
        linear_num_value_heads=8, linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=payload["seq_len"], pad_token_id=0)


def _live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            key = obj.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
    return total

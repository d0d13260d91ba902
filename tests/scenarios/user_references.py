"""What a user's code holds of the model's activations through fit, validate, test and predict
(``tests/test_user_references.py``): forward hooks on the projections that keep their outputs, an attention subclass
that stores its rotated query on itself and its query and key in a module-level dict of a tuple. The same lifecycle
runs here (2 ranks, under the strategy) and in the test process (one device, plain Lightning)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.pytorch import seed_everything
from torch.utils.data import DataLoader

from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer

PHASES = ("fit", "validate", "test", "predict")
HELD: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a user's module-level store: a dict of a tuple
ROWS, SEQ_LEN, BATCH, STEPS = 2, 32, 2, 2  # one batch: every device trains on the same rows each step


def _stores_query_class():
    from transformers.models.llama.modeling_llama import (ALL_ATTENTION_FUNCTIONS, LlamaAttention,
                                                          apply_rotary_pos_emb, eager_attention_forward)

    class StoresQuery(LlamaAttention):
        """A user's attention: Llama's forward, keeping the rotated query on itself and q, k in a dict of a tuple."""

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                    **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
            self.kept_query = query_states
            HELD["layer"] = (query_states, key_states)
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                              eager_attention_forward)
            out, weights = attention(self, query_states, key_states, value_states, attention_mask, dropout=0.0,
                                     scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return StoresQuery


class KeepingLM(CausalLM):
    """The user's module: hooks on every layer's q/k/v projections keep each output (the tensor itself) with the
    phase it was made in and whether backward was running (an activation checkpoint's recompute); the second layer's
    attention is a subclass that stores its query."""

    def __init__(self, config, dataset) -> None:
        super().__init__(config, lr=0.5, dataset=dataset, batch_size=BATCH)
        self.phase = "fit"
        self.kept: list[tuple[str, str, bool, torch.Tensor]] = []
        self.model.model.layers[1].self_attn.__class__ = _stores_query_class()
        for name, module in self.model.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj")):
                module.register_forward_hook(self._keeper(name))

    def _keeper(self, name: str):
        def keep(module, args, output):
            in_backward = torch._C._current_graph_task_id() != -1
            self.kept.append((self.phase, name, in_backward, output))

        return keep

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"]).logits

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


def lifecycle(strategy: Any, checkpointing: bool = False) -> dict:
    """fit (``STEPS`` SGD steps), validate, test, predict with ``strategy``; what the user's references hold after
    each phase (clones taken at the phase's end: a tensor changed after its hook ran shows here)."""
    seed_everything(SEED, verbose=False)
    module = KeepingLM(tiny_llama_config(num_kv_heads=2), TokenDataset(ROWS, SEQ_LEN))
    if checkpointing:  # one device's equivalent of offload_checkpoints: Hugging Face's gradient checkpointing
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    devices = LAUNCH_WORLD_SIZE if strategy is not None else 1
    trainer = make_trainer(strategy if strategy is not None else "auto", STEPS, devices=devices, limit_val_batches=1.0)
    results: dict[str, Any] = {}
    attention = module.model.model.layers[1].self_attn
    for phase in PHASES:
        module.phase = phase
        start = len(module.kept)
        os.environ["WORLD_SIZE"] = str(devices)  # Lightning's teardown removes it after every run
        if phase == "fit":
            trainer.fit(module)
        else:
            getattr(trainer, phase)(module, verbose=False) if phase != "predict" else trainer.predict(module)
        entries = module.kept[start:]
        results[phase] = {
            "kept": [(name, in_backward, tensor.detach().float().clone()) for _, name, in_backward, tensor in entries],
            "calls": len(entries),
            "query_on_module": attention.kept_query.detach().float().clone(),
            "query_in_dict": HELD["layer"][0].detach().float().clone(),
            "key_in_dict": HELD["layer"][1].detach().float().clone(),
        }
    return results


def run(payload: dict) -> dict:
    """The lifecycle under each strategy setting of ``payload["settings"]`` (name -> strategy keywords)."""
    from lightning_ulysses import UlyssesDeepSpeedStrategy
    from lightning_ulysses.offload import attention_block

    results = {}
    for name, keywords in payload["settings"].items():
        owned = attention_block.OWNED_CALLS[0]
        keywords = dict(keywords)
        config = keywords.pop("config", None)
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, **keywords)
        if config:
            strategy.config["zero_optimization"].update(config)
        results[name] = lifecycle(strategy)
        results[name]["owned_attention_calls"] = attention_block.OWNED_CALLS[0] - owned
        results[name]["sp_rank"] = strategy.sp_rank
    return results


def one_device(checkpointing: bool) -> dict:
    """The same lifecycle on one device, plain Lightning (in the test process)."""
    return lifecycle(None, checkpointing)


__all__ = ["PHASES", "one_device", "run"]


def shard_of(whole: torch.Tensor, sp_rank: int, sp: int = 2, dim: int = 1) -> Optional[torch.Tensor]:
    """This rank's contiguous shard of a one-device tensor along its sequence dimension."""
    s = whole.shape[dim] // sp
    return whole.narrow(dim, sp_rank * s, s)

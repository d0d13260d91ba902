"""Scenarios for models that are not Hugging Face models: the public Ulysses attention wrapper against full
attention, and a from-scratch GPT trained with the strategy (``attention_modules=[AttentionCore]``)."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy, ulysses_attention
from tests.support.models import SEED, TokenDataset
from tests.support.training import make_trainer

def load_gpt_example():
    """The example's GPT module, ``examples/gpt_from_scratch.py`` (one definition for example and tests)."""
    import examples.gpt_from_scratch

    return examples.gpt_from_scratch


def wrapper_checks(payload: dict) -> list[dict]:
    """``ulysses_attention`` forward and backward vs. full SDPA on one process, per head layout; collectives."""
    from torch.distributed.tensor.debug import CommDebugMode

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    group, sp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    results = []
    for case in payload["cases"]:
        B, S, D, Hq, Hkv, causal = case["B"], case["S"], 8, case["Hq"], case["Hkv"], case["causal"]
        g = torch.Generator().manual_seed(Hq * 100 + Hkv * 10 + causal)
        q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
        grad = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=Hq != Hkv)
        expected.backward(grad)
        s = S // sp
        cut = slice(rank * s, (rank + 1) * s)
        shards = [t[:, :, cut].clone().requires_grad_() for t in (q, k, v)]
        with CommDebugMode() as comm:
            out = ulysses_attention(*shards, group, is_causal=causal)
            out.backward(grad[:, :, cut])
        errors = {"out": (out - expected[:, :, cut]).abs().max().item()}
        for name, shard, reference in zip("qkv", shards, full):
            errors["d" + name] = (shard.grad - reference.grad[:, :, cut]).abs().max().item()
        results.append({**case, "errors": errors, "out_shape": tuple(out.shape),
                        "collectives": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}})
    return results


class WeightsRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.input_shapes: list[tuple[int, ...]] = []
        self.shard_positions: list[tuple[list[int], list[int]]] = []  # (strategy.shard_positions, batch position_ids)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.input_shapes.append(tuple(batch["input_ids"].shape))
        positions = trainer.strategy.shard_positions(batch["input_ids"].shape[1])
        self.shard_positions.append((positions.tolist(), batch["position_ids"][0].tolist()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module) -> None:
        import deepspeed

        params = dict(pl_module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None,
                                               enabled=trainer.strategy.zero_stage_3):
            self.weights = {k: v.detach().clone() for k, v in params.items()}


def gpt_parity(payload: dict) -> list[dict]:
    """SGD fits of the example GPT with the strategy wrapping its AttentionCore."""
    gpt = load_gpt_example()
    results = []
    for run in payload["runs"]:
        seed_everything(SEED, verbose=False)
        cfg = gpt.GPTConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=run["heads"], n_kv_head=run["kv_heads"],
                            n_embd=8 * run["heads"])
        module = gpt.GPTModule(cfg, lr=run["lr"], optimizer="sgd")
        if run.get("omit_positions"):  # a user step that leaves positions to the model's own default
            module.training_step = lambda batch, batch_idx, m=module: m.trainer.strategy.cross_entropy(
                m.gpt(batch["input_ids"]), batch["shift_labels"])
        data = torch.utils.data.DataLoader(TokenDataset(run["num_rows"], run["seq_len"]), batch_size=1)
        recorder = WeightsRecorder()
        strategy = UlyssesDeepSpeedStrategy(sp_size=run["sp_size"], stage=run["stage"],
                                            attention_modules=[gpt.AttentionCore])
        trainer = make_trainer(strategy, run["steps"], callbacks=[recorder])
        trainer.fit(module, data)
        results.append({"losses": recorder.losses, "input_shapes": recorder.input_shapes,
                        "shard_positions": recorder.shard_positions,
                        "weights": recorder.weights if dist.get_rank() == 0 else None,
                        "unwrapped": all("forward" not in m.__dict__ for m in module.modules()
                                         if isinstance(m, gpt.AttentionCore))})
    return results

"""What the launched processes of tests/test_fabric.py run: Fabric scripts as a user writes them, with the Fabric
``UlyssesDeepSpeedStrategy`` as the only change, returning what each rank saw (losses, trained weights)."""

from __future__ import annotations

import os

for _name in filter(None, os.environ.pop("ULYSSES_TEST_UNSET_ENV", "").split(",")):
    os.environ.pop(_name, None)  # a simulated SLURM job carries no torchrun-style variables (tests/test_launchers.py)

from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.support.models import SEED, VOCAB, TokenDataset, build_llama, tiny_llama_config  # noqa: E402

LAUNCH_WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
LR = 0.5


def build_model(model: str, seed: int = 0) -> torch.nn.Module:
    """The models the Fabric tests train: a Hugging Face Llama, an own model with declared attention cores, LitGPT
    GPTs of three families."""
    if model == "llama":
        return build_llama(tiny_llama_config(num_kv_heads=2), seed)
    if model == "own":  # examples/gpt_from_scratch.py's GPT: its attention cores declared to the strategy
        import examples.gpt_from_scratch as gpt

        torch.manual_seed(seed)
        return gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    from tests.support.forms import LITGPT_FORMS, _litgpt

    extended_context = {  # LitGPT's RoPE settings for long contexts, kept in the shrunk configs
        "litgpt-llama3.1": _litgpt("Llama-3.1-8B", n_query_groups=2, intermediate_size=96),  # rope_adjustments
        "litgpt-llama2-32k": _litgpt("LLaMA-2-7B-32K", n_query_groups=2, intermediate_size=96),  # condensed RoPE
    }
    if model == "litgpt-lora":  # LitGPT's LoRA fine-tuning model: adapters on the query and value, base frozen
        from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

        config = Config.from_name("tiny-llama-1.1b", n_layer=2, n_embd=64, n_head=4, head_size=16, block_size=64,
                                  vocab_size=VOCAB, padded_vocab_size=VOCAB, n_query_groups=2, intermediate_size=96,
                                  lora_r=4, lora_alpha=8, lora_query=True, lora_value=True)
        torch.manual_seed(seed)
        lora = GPT(config)
        lora.apply(lora._init_weights)
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:  # LoRA starts at zero; a step from there shows where the gradients land
                torch.nn.init.normal_(parameter, std=0.02)
        mark_only_lora_as_trainable(lora)
        return lora
    if model == "litgpt-adapter":  # LitGPT's adapter fine-tuning model: learned prefix attention, base frozen
        from litgpt.adapter import GPT, Config, mark_only_adapter_as_trainable

        config = Config.from_name("tiny-llama-1.1b", n_layer=2, n_embd=64, n_head=4, head_size=16, block_size=64,
                                  vocab_size=VOCAB, padded_vocab_size=VOCAB, n_query_groups=2, intermediate_size=96,
                                  adapter_prompt_length=4, adapter_start_layer=0)
        torch.manual_seed(seed)
        adapter = GPT(config)
        adapter.apply(adapter._init_weights)
        for name, parameter in adapter.named_parameters():
            if "gating_factor" in name:  # starts at zero; a step from there shows where the gradients land
                torch.nn.init.normal_(parameter, std=0.02)
        mark_only_adapter_as_trainable(adapter)
        return adapter
    return {**LITGPT_FORMS, **extended_context}[model](seed)


class InstructionDataset(torch.utils.data.Dataset):
    """LitGPT fine-tuning samples: variable lengths, the prompt's labels masked (-100), ``token_counts`` as LitGPT's
    SFT datasets give them; batched by LitGPT's own ``get_sft_collate_fn`` (right padding)."""

    def __init__(self, num_rows: int, seed: int = 11) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(20, 33, (num_rows,), generator=g).tolist()
        self.rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = self.rows[i]
        labels = ids.clone()
        labels[:6] = -100  # the prompt
        return {"input_ids": ids, "labels": labels, "token_counts": {"raw": len(ids) - 6,
                                                                      "raw_plus_prompt_template": len(ids)}}


def sft_collate():
    from litgpt.data.base import get_sft_collate_fn

    return get_sft_collate_fn(max_seq_length=32, pad_id=0, ignore_index=-100)


def loss_of(model_name: str, model: Any, batch: dict, strategy: Any) -> torch.Tensor:
    """The step a user writes: a Hugging Face model's own loss; logits and the strategy's loss otherwise."""
    if model_name == "llama":
        return model(**batch).loss
    logits = model(batch["input_ids"])
    return strategy.cross_entropy(logits, batch["shift_labels"])


FABRIC_ARGS: dict = {}  # the payload's "fabric" arguments (devices, num_nodes); else one node of WORLD_SIZE devices


def _fabric(case: dict):
    import lightning as L

    from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy

    extra = dict(case.get("strategy", {}))
    if case["model"] == "own":
        import examples.gpt_from_scratch as gpt

        extra["attention_modules"] = [gpt.AttentionCore]
    strategy = UlyssesDeepSpeedStrategy(sp_size=case["sp"], stage=case["stage"], **extra)
    if not case.get("clip"):  # Fabric leaves DeepSpeed's default, clipping at norm 1.0, which hides a wrong scale
        strategy.config["gradient_clipping"] = 0.0
    arguments = FABRIC_ARGS or {"devices": LAUNCH_WORLD_SIZE}
    fabric = L.Fabric(accelerator=case.get("accelerator", "cpu"), strategy=strategy, precision="32-true", **arguments)
    fabric.launch()
    return fabric, strategy


def _weights(fabric, model, stage: int) -> dict:
    import deepspeed

    params = dict(model.module.named_parameters())  # the user's module inside Fabric's and DeepSpeed's wrappers
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=stage == 3):
        weights = {k: v.detach().float().cpu().clone() for k, v in params.items()}
    return weights if fabric.global_rank == 0 else None


def train(case: dict) -> dict:
    """SGD steps of ``case["model"]`` under Fabric; the losses and the trained weights (rank 0).

    Options: ``"gas"``: DeepSpeed's gradient accumulation (``optimizer.step()`` after every micro-batch, as Fabric
    documents it); ``"save"``: a checkpoint directory to ``fabric.save`` after the steps; ``"load"``: one to
    ``fabric.load`` first, then the batches it saw skipped, as a resuming script does."""
    from lightning.fabric import seed_everything

    if not FABRIC_ARGS:  # under the torchrun-style launch: Lightning's teardown may have removed it
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    seed_everything(SEED, verbose=False)
    fabric, strategy = _fabric(case)
    if case.get("gas"):
        strategy.config["gradient_accumulation_steps"] = case["gas"]
    if case.get("pretrained"):  # a checkpoint loaded as Fabric documents it: inside fabric.init_module()
        from transformers import AutoModelForCausalLM

        with fabric.init_module():
            model = AutoModelForCausalLM.from_pretrained(case["pretrained"], attn_implementation="sdpa")
    else:
        model = build_model(case["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    if case.get("sft"):  # LitGPT's fine-tuning data path: its dataset format and its collate function
        loader = DataLoader(InstructionDataset(case["rows"]), batch_size=case["batch"], shuffle=True,
                            collate_fn=sft_collate())
    else:
        loader = DataLoader(TokenDataset(case["rows"], case["seq_len"]), batch_size=case["batch"], shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if case.get("load"):
        remainder = fabric.load(case["load"], state)
        if "step" in remainder:  # Fabric puts plain values it cannot restore in place into what it returns
            state["step"] = remainder["step"]
    losses = []
    model.train()
    batches = iter(loader)
    for _ in range(state["step"]):  # the batches the saved run trained on
        next(batches)
    window = case.get("window", 1)  # accumulation as Fabric documents it: no_backward_sync, backward(loss / k)
    for micro in range(case["steps"]):
        batch = next(batches)
        accumulating = (micro + 1) % window != 0
        with fabric.no_backward_sync(model, enabled=accumulating and not case.get("without_no_sync")):
            loss = loss_of(case["model"], model, batch, strategy)
            fabric.backward(loss / window)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        state["step"] += 1
    if case.get("save"):
        fabric.save(case["save"], state)
    return {"losses": losses, "weights": _weights(fabric, model, case["stage"]),
            "form_checks": strategy.form_checks_run, "dp_size": strategy.dp_size, "start": state["step"] - len(losses),
            "chosen_sp": strategy.auto_choice.sp_size if strategy.auto_choice is not None else None,
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "sp_group": strategy.layout.sp_group_ranks(), "node_rank": strategy.node_rank}


def refusals(payload: dict) -> dict:
    """What a Fabric script gets when it does what the strategy cannot run exactly: the error on every rank."""
    import lightning_ulysses

    results = {}
    for name in payload["refusals"]:
        case = {"model": {"litgpt_chunked_loss": "litgpt-pythia", "litgpt_adapter": "litgpt-adapter",
                          "litgpt_generation": "litgpt-llama"}.get(name, "llama"),
                "sp": 2, "stage": 3 if name.endswith("zero3") else 2}
        fabric, strategy = _fabric(case)
        model = build_model(case["model"])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        try:
            if name == "accumulation_config":  # DeepSpeed's own window, which Fabric's optimizer step bypasses
                strategy.config["gradient_accumulation_steps"] = 2
            if name.startswith("evaluation_only"):  # not refused: `fabric.setup_module`, no optimizer, its own loss
                model = fabric.setup_module(model)
                loader = fabric.setup_dataloaders(DataLoader(TokenDataset(4, 32), batch_size=2))
                model.eval()
                with torch.no_grad():
                    results[name] = [model(**batch).loss.item() for batch in loader]
                continue
            model, optimizer = fabric.setup(model, optimizer)
            seed = 7 + fabric.global_rank if name == "peers_read_different_batches" else 7  # a per-rank data seed
            loader = fabric.setup_dataloaders(DataLoader(TokenDataset(4, 32, seed=seed), batch_size=2))
            batch = next(iter(loader))
            if name == "tokens_not_from_a_loader":  # a full batch made in the loop
                model(input_ids=torch.randint(1, VOCAB, (2, 32)))
            elif name == "litgpt_generation":  # not refused: LitGPT's KV-cache generation runs plain, after a step
                fabric.backward(strategy.cross_entropy(model(batch["input_ids"]), batch["shift_labels"]))
                optimizer.zero_grad()  # no step: the weights stay the initial ones
                from litgpt.generate.base import generate

                model.module.set_kv_cache(batch_size=1)
                results[name] = generate(model, torch.tensor([5, 6, 7, 8]), max_returned_tokens=12,
                                         temperature=0.0).tolist()
                continue
            elif name == "teardown":  # not refused: everything the strategy changed is given back
                fabric.backward(model(**batch).loss)
                hf_model, engine = model.module, strategy.deepspeed_engine
                during = {"attention": hf_model.config._attn_implementation,
                          "collate": type(loader._dataloader.dataloader.collate_fn).__name__,
                          "engine_hooks": len(engine._forward_pre_hooks) + len(engine._forward_hooks)}
                strategy.teardown()
                after = {"attention": hf_model.config._attn_implementation,
                         "collate": type(loader._dataloader.dataloader.collate_fn).__name__,
                         "engine_hooks": len(engine._forward_pre_hooks) + len(engine._forward_hooks)}
                results[name] = {"during": during, "after": after}
                continue
            elif name == "peers_read_different_batches":  # the SP peers hold shards of different sequences
                model(**batch)
            elif name == "second_model":
                fabric.setup(build_model("llama"), torch.optim.SGD(model.parameters(), lr=LR))
            elif name == "litgpt_chunked_loss":  # LitGPT's recipe on the shard: a per-shard mean, its own shift
                from litgpt.utils import chunked_cross_entropy

                logits = model(batch["input_ids"])
                fabric.backward(chunked_cross_entropy(logits[..., :-1, :], batch["input_ids"][..., 1:]))
            elif name == "full_batch_evaluation":  # not refused: a full batch outside the loaders, SP on request
                model.eval()
                full = {"input_ids": TokenDataset(4, 32).rows[:2], "labels": TokenDataset(4, 32).rows[:2]}
                results[name] = strategy.evaluate_full_batch(model, full)["loss"].tolist()  # [B, s] of this rank
                continue
            elif name == "second_backward_without_no_sync":  # ZeRO-2 would keep only the second one's gradients
                fabric.backward(model(**batch).loss / 2)
                fabric.backward(model(**batch).loss / 2)
            results[name] = "no error"
        except (ValueError, RuntimeError, lightning_ulysses.SPLossMismatchError,
                lightning_ulysses.SPPeerMismatchError) as err:
            results[name] = f"{type(err).__name__}: {err}"
    return results


def run(payload: dict) -> dict:
    FABRIC_ARGS.update(payload.get("fabric", {}))
    results = {case["name"]: train(case) for case in payload.get("cases", [])}
    if payload.get("refusals"):
        results["refusals"] = refusals(payload)
    return results

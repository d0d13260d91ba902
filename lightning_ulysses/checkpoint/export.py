"""Portable export of a checkpoint of :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy`: :func:`export_checkpoint`
turns a (ZeRO-sharded) checkpoint directory into one fp32 ``state_dict`` file and, for every Hugging Face model in the
LightningModule, a ``save_pretrained`` directory with a plain config (the original attention, ``use_cache`` as before
training), loadable without this package, DeepSpeed or SP. One process, CPU, any layout that wrote the checkpoint.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.checkpoint import integrity
from lightning_ulysses.checkpoint.markers import (
    CLIENT_STATE_KEY,
    DEEPSPEED_TAG,
    PathLike,
    checkpoint_status,
    digest_mismatch_error,
    read_marker,
    verify_digests,
)
from lightning_ulysses.models import hf


def consolidated_state_dict(checkpoint: PathLike, tag: Optional[str] = None) -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, Any]]:
    """``(fp32 state_dict, Lightning's client state)`` of a DeepSpeed checkpoint directory at any ZeRO stage, on CPU,
    in one process (no DeepSpeed engine, no process group). The state_dict keys are the LightningModule's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = Path(checkpoint)
    if tag is None:
        latest = checkpoint / "latest"
        tag = latest.read_text().strip() if latest.is_file() else DEEPSPEED_TAG
    ds_dir = checkpoint / tag
    if not ds_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint} is not a DeepSpeed checkpoint directory (no {tag}/ inside)")
    model_files = sorted(ds_dir.glob("*model_states.pt"))
    if not model_files:
        raise FileNotFoundError(f"No *model_states.pt in {ds_dir}")
    rank0_file = ds_dir / ("mp_rank_00_model_states.pt" if (ds_dir / "mp_rank_00_model_states.pt").is_file()
                           else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    client_state = torch.load(rank0_file, map_location="cpu", weights_only=True)  # see integrity.restricted_torch_load
    if any(ds_dir.glob("*optim_states.pt")):  # ZeRO 1-3: the fp32 master weights live in the optimizer shards
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
    else:  # ZeRO 0: rank 0 saved the whole module
        state_dict = client_state["module"]
    state_dict = {_strip(k, "_forward_module."): (v.float() if v.is_floating_point() else v).cpu()
                  for k, v in state_dict.items()}
    deepspeed_keys = {"module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                      "global_steps", "global_samples", "dp_world_size", "mp_world_size", "buffer_names",
                      "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
                      "ds_config", "ds_version", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                      "parallel_dims"}
    client_state = {k: v for k, v in client_state.items() if k not in deepspeed_keys}
    return state_dict, client_state


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if key.startswith(prefix) else key


def _import(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def export_checkpoint(
    checkpoint: PathLike,
    output_dir: PathLike,
    hf_models: Optional[dict[str, Union[nn.Module, Callable[[], nn.Module]]]] = None,
    tag: Optional[str] = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Export a checkpoint of :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy` (a directory, ZeRO-sharded or not)
    into files that load without DeepSpeed, sequence parallelism or this package. One process, CPU, no GPU needed.

    Writes into ``output_dir``:

    * ``model.pt``: ``torch.load`` gives Lightning's checkpoint dict with a consolidated fp32 ``state_dict`` (the
      LightningModule's keys) and the training state Lightning saved (``epoch``, ``global_step``,
      ``hyper_parameters``, ...), so ``MyModule.load_from_checkpoint("out/model.pt")`` and
      ``module.load_state_dict(torch.load("out/model.pt")["state_dict"])`` both work.
    * ``<name>/`` for every Hugging Face ``PreTrainedModel`` in the LightningModule (``name`` is its attribute path,
      e.g. ``model``): a ``save_pretrained`` directory in fp32 with a plain config (no Ulysses attention, the original
      ``use_cache``): ``AutoModelForCausalLM.from_pretrained("out/model")``. The models are rebuilt from what the
      strategy recorded in the checkpoint; ``hf_models={"model": LlamaForCausalLM(config)}`` (an instance or a
      factory) exports a checkpoint that has no record (e.g. one saved by Lightning's ``DeepSpeedStrategy``).
    * For a model wrapped by PEFT (LoRA, ...): ``<name>/`` holds the model with the adapters *merged* into its
      weights (plain transformers loads it), and ``<name>_adapter/`` the adapters alone (PEFT's
      ``save_pretrained``: ``PeftModel.from_pretrained(base_model, "out/model_adapter")``). Needs ``peft``.

    The checkpoint's files are read with ``torch.load(weights_only=True)`` (DeepSpeed's and Lightning's classes
    allow-listed), so a checkpoint from elsewhere cannot run code here; with ``verify=True`` (default) every file's
    SHA-256 is checked against the marker first (a same-size corruption is refused).

    Returns ``{"state_dict": Path, "hf": {name: Path}, "global_step": int}``.
    """
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    marker = read_marker(checkpoint)
    if marker is not None:
        complete, why = checkpoint_status(checkpoint)
        if not complete:
            raise ValueError(f"Cannot export: {why}.")
        wrong = verify_digests(checkpoint) if verify else []
        if wrong:
            raise ValueError(f"Cannot export: {digest_mismatch_error(checkpoint, wrong)}")
    with integrity.restricted_torch_load():
        state_dict, client_state = consolidated_state_dict(checkpoint, tag)
    output_dir.mkdir(parents=True, exist_ok=True)
    state_file = output_dir / "model.pt"
    torch.save({**client_state, "state_dict": state_dict}, state_file)

    record = client_state.get(CLIENT_STATE_KEY, {}) or {}
    targets: dict[str, Any] = dict(record.get("hf_models", {}))
    targets.update(hf_models or {})
    exported: dict[str, Path] = {}
    for name, target in targets.items():
        model = _build_hf_model(target)
        adapters = target.get("peft") if isinstance(target, dict) else None
        if adapters:
            model = _wrap_with_adapters(model, adapters)
        prefix = f"{name}." if name else ""
        weights = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not weights:
            raise KeyError(f"The checkpoint has no weights under {prefix!r} for the Hugging Face model {name!r}.")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {f"base_model.model.{k}" if adapters else k for k in (getattr(model, "_tied_weights_keys", None) or ())}
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise KeyError(f"The checkpoint's weights under {prefix!r} do not fit {type(model).__name__}:"
                           f" missing {missing}, unexpected {unexpected}.")
        if adapters:
            model.save_pretrained(output_dir / f"{name or 'hf_model'}_adapter")
            model = model.merge_and_unload()  # the plain model with W + scale * B @ A in its weights
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        hf.restore_model(model)  # a model handed in prepared for SP is plain again
        target_dir = output_dir / (name or "hf_model")
        model.save_pretrained(target_dir)
        exported[name] = target_dir
    return {"state_dict": state_file, "hf": exported, "global_step": client_state.get("global_step")}


def _wrap_with_adapters(model: nn.Module, adapters: dict[str, dict[str, Any]]) -> nn.Module:
    """``model`` wrapped by PEFT with the recorded adapters (weights loaded afterwards)."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as err:
        raise ImportError("This checkpoint holds a PEFT (LoRA) model: `pip install peft` to export it.") from err
    (first_name, first), *others = adapters.items()
    peft_model = get_peft_model(model, PeftConfig.from_peft_type(**first), adapter_name=first_name)
    for adapter_name, config in others:
        peft_model.add_adapter(adapter_name, PeftConfig.from_peft_type(**config))
    return peft_model


def _build_hf_model(target: Any) -> nn.Module:
    if isinstance(target, nn.Module):
        return target
    if callable(target):
        return target()
    model_class = _import(target["class"])
    config_dict = dict(target["config"])
    config = model_class.config_class.from_dict(config_dict)
    impl = target.get("attn_implementation") or "sdpa"
    try:
        return _compat.model_from_config(model_class, config, attn_implementation=impl, dtype=torch.float32)
    except (ImportError, ValueError):  # e.g. flash-attn is not installed here: the weights do not care
        return _compat.model_from_config(model_class, config, attn_implementation="sdpa", dtype=torch.float32)

"""Guards for every private-API touch point of :mod:`lightning_ulysses._compat`: each test fails when the upstream
name, signature or behaviour the package relies on changes, so that an upgrade of Lightning, DeepSpeed, torch or
transformers breaks a named test here instead of training silently wrong. In-process, no launch."""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses import _compat


def _digest(function) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(function)).encode()).hexdigest()[:16]


def _initialize_keywords(function) -> set:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "initialize"]
    assert len(calls) == 1
    return {keyword.arg for keyword in calls[0].keywords}


# ================================================================================================ Lightning
# Lightning's private engine set-up methods as _compat.py copied them (lightning 2.6.x). A new digest means Lightning
# changed the method: compare _compat.initialize_training_engine / initialize_inference_engine with it, then update.
LIGHTNING_ENGINE_SETUP = {"_setup_model_and_optimizer": ("d5b228d023b53b92", _compat.initialize_training_engine),
                          "_initialize_deepspeed_inference": ("44374170d2e2a741", _compat.initialize_inference_engine)}


@pytest.mark.parametrize("name", sorted(LIGHTNING_ENGINE_SETUP))
def test_engine_setup_follows_lightnings_private_methods(name):
    """The strategy's overrides of Lightning's ``_setup_model_and_optimizer`` / ``_initialize_deepspeed_inference``
    take the same arguments, ``_compat``'s bodies pass ``deepspeed.initialize`` the same keywords plus ``mpu``, and
    were made from the Lightning code installed now (its source digest)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    digest, body = LIGHTNING_ENGINE_SETUP[name]
    theirs, ours = getattr(DeepSpeedStrategy, name), getattr(UlyssesDeepSpeedStrategy, name)
    assert _digest(theirs) == digest, f"Lightning changed {name}"
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    assert _initialize_keywords(body) == _initialize_keywords(theirs) | {"mpu"}, name


# Fabric's DeepSpeedStrategy methods the Fabric front end overrides with their body copied or wrapped (lightning 2.6.x).
# A new digest means Fabric changed the method: compare lightning_ulysses/fabric.py's override with it, then update.
FABRIC_OVERRIDDEN = {"_setup_distributed": "a24351400d46ed98", "_initialize_engine": "3ce165d771db9b66",
                     "setup_module_and_optimizers": "5d590e4b6e684053", "setup_module": "cd6ad66d058c82ec",
                     "load_checkpoint": "7ff5bd894df281b2", "save_checkpoint": "3cde990985dcf02a"}


@pytest.mark.parametrize("name", sorted(FABRIC_OVERRIDDEN))
def test_fabric_front_end_follows_fabrics_deepspeed_strategy(name):
    """The Fabric front end's overrides take the arguments of Fabric's methods, which are the code installed now."""
    from lightning.fabric.strategies import DeepSpeedStrategy

    from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy

    theirs, ours = getattr(DeepSpeedStrategy, name), getattr(UlyssesDeepSpeedStrategy, name)
    assert _digest(theirs) == FABRIC_OVERRIDDEN[name], f"Fabric changed DeepSpeedStrategy.{name}"
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    if name == "_initialize_engine":
        assert _initialize_keywords(_compat.initialize_training_engine) == _initialize_keywords(theirs) | {"mpu"}


def test_fabric_steps_deepspeeds_optimizer_and_hands_no_backward_sync_to_the_strategy():
    """What the Fabric front end's accumulation rests on: ``optimizer.step()`` reaches DeepSpeed's optimizer, not the
    engine (the engine is not ``Optimizable``), so DeepSpeed's own accumulation window never closes; and
    ``fabric.no_backward_sync`` calls the strategy's ``_backward_sync_control`` with the engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.fabric import Fabric
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.fabric.wrappers import _FabricOptimizer

    assert "isinstance(self._strategy.model, Optimizable)" in inspect.getsource(_FabricOptimizer.step)
    assert not hasattr(DeepSpeedEngine, "param_groups")  # one of Optimizable's members
    assert "_backward_sync_control.no_backward_sync(forward_module, enabled)" in inspect.getsource(
        Fabric.no_backward_sync)
    assert list(inspect.signature(_BackwardSyncControl.no_backward_sync).parameters) == ["self", "module", "enabled"]
    from lightning.fabric.utilities.load import _move_state_into

    assert list(inspect.signature(_move_state_into).parameters) == ["source", "destination", "keys"]


def test_auto_select_batch_size_is_a_method_the_strategy_can_override():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert list(inspect.signature(DeepSpeedStrategy._auto_select_batch_size).parameters) == ["self"]
    assert "batch_sampler.batch_size" in inspect.getsource(DeepSpeedStrategy._auto_select_batch_size)


def _tiny_fit(accumulate: int = 2, batches: int = 3, **trainer_kwargs):
    """A plain one-device fit of a one-layer module that records ``_compat`` answers from inside its steps."""
    from lightning.pytorch import LightningModule, Trainer

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.continues: list[bool] = []

        def training_step(self, batch, batch_idx):
            self.continues.append(_compat.window_continues(self.trainer))
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(batches, 2), batch_size=1)

    module = Tiny()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulate, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                      **trainer_kwargs)
    trainer.fit(module)
    return trainer, module


def test_lightning_fit_loop_touch_points():
    """``window_continues`` (``fit_loop._should_accumulate``) answers Lightning's windows, the last batch of an epoch
    ending one; ``continue_epoch_at`` moves the four counts of the epoch's batch progress together; the loop state in
    a checkpoint holds the batch progress under ``BATCH_PROGRESS_KEY``; ``train_loader_of`` finds the module's loader;
    ``attached_trainer`` is the module's Trainer or ``None``; ``device_mesh`` returns what ``set_device_mesh`` set."""
    trainer, module = _tiny_fit(accumulate=2, batches=3)
    assert module.continues == [True, False, False]  # window of 2, then the epoch's last batch ends a window

    current = trainer.fit_loop.epoch_loop.batch_progress.current
    before = (current.ready, current.started, current.processed, current.completed)
    _compat.continue_epoch_at(trainer, current.ready + 5)
    assert (current.ready, current.started, current.processed, current.completed) == tuple(v + 5 for v in before)

    assert _compat.BATCH_PROGRESS_KEY in trainer.fit_loop.state_dict()
    assert set(trainer.fit_loop.state_dict()[_compat.BATCH_PROGRESS_KEY]["current"]) >= {"ready", "completed"}

    loader = _compat.train_loader_of(trainer)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 3

    assert _compat.attached_trainer(module) is trainer
    from lightning.pytorch import LightningModule

    assert _compat.attached_trainer(LightningModule()) is None
    marker = object()
    _compat.set_device_mesh(module, marker)
    assert module.device_mesh is marker


def test_lightning_remove_module_hooks_removes_forward_pre_hooks():
    """Lightning's inference set-up removes every module hook (why the strategy installs its own again after it)."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    seen = []
    module[0].register_forward_pre_hook(lambda m, args: seen.append(1))
    _compat.remove_module_hooks(module)
    module(torch.ones(1, 2))
    assert seen == []
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert "remove_module_hooks(model)" in inspect.getsource(DeepSpeedStrategy._initialize_deepspeed_inference)


# ================================================================================================ DeepSpeed
def test_deepspeed_checkpoint_name_hook():
    """DeepSpeed's engine asks ``self._get_ckpt_name(path, tag, mp, pp)`` for the model-states file it loads and
    saves (what :func:`_compat.checkpoint_name_override` answers instead)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert list(inspect.signature(DeepSpeedEngine._get_ckpt_name).parameters) == [
        "self", "checkpoints_path", "tag", "mp_placeholder", "pp_placeholder"]
    assert "self._get_ckpt_name(" in inspect.getsource(DeepSpeedEngine._get_all_ckpt_names)

    class Engine:
        pass

    engine = Engine()
    with _compat.checkpoint_name_override(engine, lambda *a: "named"):
        assert engine._get_ckpt_name("p", "t") == "named"
    assert not hasattr(engine, "_get_ckpt_name")


def test_deepspeed_zero_optimizer_state_names():
    """Every ZeRO optimizer attribute re-partitioning reads is assigned by DeepSpeed's optimizer, and the private
    methods it calls exist with the arguments it passes."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls, names in ((DeepSpeedZeroOptimizer, _compat.ZERO12_STATE), (DeepSpeedZeroOptimizer_Stage3,
                                                                        _compat.ZERO3_STATE)):
        source = inspect.getsource(cls)
        missing = [name for name in names if f"self.{name} =" not in source and f"self.{name}:" not in source]
        assert not missing, f"{cls.__name__} no longer sets {missing}"
    assert list(inspect.signature(DeepSpeedZeroOptimizer._link_all_hp_params).parameters) == ["self"]
    for name in ("_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups"):
        assert list(inspect.signature(getattr(DeepSpeedZeroOptimizer_Stage3, name)).parameters) == ["self"]


def test_deepspeed_restore_from_bit16_weights_hook():
    """DeepSpeed's checkpoint loading ends with ``optimizer._restore_from_bit16_weights()``; the ZeRO optimizers have
    it and ZeRO-3's parameter-offload stand-in (an inference engine's "optimizer") does not: the override's case."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "self.optimizer._restore_from_bit16_weights()" in inspect.getsource(DeepSpeedEngine.load_checkpoint)
    assert _compat.has_restore_from_bit16(DeepSpeedZeroOptimizer)
    assert _compat.has_restore_from_bit16(DeepSpeedZeroOptimizer_Stage3)
    assert not _compat.has_restore_from_bit16(DeepSpeedZeRoOffload)


def test_deepspeed_zero3_gradient_partitions_buffer():
    """ZeRO-3 keeps every parameter's gradient partition in one flat buffer that it overwrites only for parameters
    whose gradient arrives (what :func:`_compat.clear_zero3_gradient_partitions` clears after each step)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    assert "self.grad_partitions_flat_buffer: Tensor = torch.zeros(" in source
    assert "grad_buffer.copy_(grad_partition" in source  # partition_grads (wrapped by an NVTX decorator)

    class Optimizer:
        grad_partitions_flat_buffer = torch.ones(3)

    _compat.clear_zero3_gradient_partitions(Optimizer)
    assert Optimizer.grad_partitions_flat_buffer.tolist() == [0.0, 0.0, 0.0]


def test_deepspeed_zero3_parameter_attributes():
    """ZeRO-3's parameter attributes the package reads or sets: the status enum, ``ds_numel``, and the gradient
    hook's ``ds_grad_is_ready`` flag (read by both ZeRO optimizers before reducing a gradient)."""
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert {"AVAILABLE", "NOT_AVAILABLE"} <= set(ZeroParamStatus.__members__)
    source = inspect.getsource(partition_parameters)
    assert "param.ds_status =" in source and "param.ds_numel =" in source and "param.ds_id =" in source
    for module in (stage3, stage_1_and_2):
        assert "ds_grad_is_ready" in inspect.getsource(module), module.__name__

    plain = torch.nn.Parameter(torch.ones(2))
    assert not _compat.is_zero3_param(plain) and not _compat.is_zero3_gathered(plain)
    plain.ds_id, plain.ds_status, plain.ds_numel = 0, ZeroParamStatus.NOT_AVAILABLE, 7
    assert _compat.is_zero3_released(plain) and _compat.zero3_numel(plain) == 7
    _compat.defer_zero3_gradient(plain, False)
    assert plain.ds_grad_is_ready is False


# ================================================================================================ torch
TORCH_OP_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu":
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float dropout_p=0.,"
        " bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key,"
        " Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None,"
        " float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
    "_scaled_dot_product_efficient_attention":
        "aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias,"
        " bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *, float? scale=None) -> (Tensor output,"
        " Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)",
    "_scaled_dot_product_efficient_attention_backward":
        "aten::_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key,"
        " Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset,"
        " float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *, float? scale=None) -> (Tensor, Tensor,"
        " Tensor, Tensor)",
}


@pytest.mark.parametrize("op", sorted(TORCH_OP_SCHEMAS))
def test_torch_private_attention_op_schemas(op):
    """The private attention ops the ring kernels call keep their argument order (the CUDA ones also run through
    torch's shape checks on the meta device in tests/test_ring.py)."""
    assert str(getattr(torch.ops.aten, op).default._schema) == TORCH_OP_SCHEMAS[op]


@pytest.mark.parametrize("causal", [False, True])
def test_torch_cpu_flash_attention_returns_output_and_logsumexp(causal):
    """Behaviour: the CPU op's output is SDPA's, its second output the log-sum-exp of the scaled scores, and its
    backward gives autograd's gradients of SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 0.5
    out, lse = _compat.cpu_flash_attention(q, k, v, causal, None, scale)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(reference, (q, k, v), dout)
    ours = _compat.cpu_flash_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                                causal, None, scale)
    for mine, theirs in zip(ours, grads):
        torch.testing.assert_close(mine, theirs)


# ================================================================================================ transformers
def test_transformers_attention_implementation_reaches_sub_configs():
    """Setting ``config._attn_implementation`` switches the sub-configs too (a vision-language model's text config),
    which the strategy relies on when it points a model at its attention functions."""
    from transformers import Gemma3Config

    config = Gemma3Config(text_config={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8},
                          vision_config={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                         "num_attention_heads": 2})
    _compat.set_attention_implementation(config, "eager")
    assert _compat.attention_implementation(config) == "eager"
    assert _compat.attention_implementation(config.text_config) == "eager"
    _compat.set_attention_implementation(config, "sdpa")
    assert _compat.attention_implementation(config.text_config) == "sdpa"


def _code_without_docstrings(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_transformers_deepspeed_switch_is_set_and_put_back():
    """transformers reads "ZeRO-3 is active" from a weak reference its ``HfDeepSpeedConfig`` registers; the switch
    sets it inside the block and leaves transformers as it was after it."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    with _compat.transformers_deepspeed_config({"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
        assert is_deepspeed_zero3_enabled()
    assert not is_deepspeed_zero3_enabled()


def test_transformers_model_from_config_builds_a_concrete_class():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = _compat.model_from_config(LlamaForCausalLM, config, attn_implementation="sdpa", dtype=torch.float32)
    assert type(model) is LlamaForCausalLM and _compat.attention_implementation(model.config) == "sdpa"


def test_torch_hook_registries():
    """A registered forward (pre-)hook is found by its handle until it is removed or the registries are cleared."""
    module = torch.nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, args: None)
    post = module.register_forward_hook(lambda m, args, out: None)
    assert _compat.hook_is_registered(module, pre) and _compat.hook_is_registered(module, post)
    pre.remove()
    assert not _compat.hook_is_registered(module, pre) and _compat.hook_is_registered(module, post)
    _compat.remove_module_hooks(module)
    assert not _compat.hook_is_registered(module, post)


def test_every_private_touch_point_lives_in_compat():
    """No module of the package but ``_compat`` names the private APIs guarded here."""
    from pathlib import Path

    import lightning_ulysses

    private = ("_should_accumulate", "batch_progress", "_data_source", "_get_ckpt_name", "_link_all_hp_params",
               "_restore_from_bit16_weights", "_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups",
               "torch.ops.aten._", "remove_module_hooks(", "ds_grad_is_ready", "._device_mesh", "'_trainer'",
               "._attn_implementation", "grad_partitions_flat_buffer", "_hf_deepspeed_config_weak_ref", "._from_config(", "._forward_pre_hooks",
               "._forward_hooks")
    root = Path(lightning_ulysses.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        code = _code_without_docstrings(path.read_text())
        hits = [name for name in private if name in code]
        if hits:
            found[str(path.relative_to(root))] = hits
    assert not found, f"private-API touch points outside _compat: {found}"


def test_the_decoders_that_pack_only_from_four_row_positions_are_those_the_table_names():
    """:data:`PACKING_FROM_FOUR_ROWS` is re-derived from the installed transformers: the modeling modules whose
    decoder takes text positions from ``[4, B, S]`` positions only (``position_ids.shape[0] == 4``)."""
    from pathlib import Path

    import transformers

    from lightning_ulysses.models.multimodal_positions import PACKING_FROM_FOUR_ROWS

    models = Path(transformers.__file__).parent / "models"
    found = {path.parent.name for path in models.glob("*/modeling_*.py")
             if "position_ids.shape[0] == 4" in path.read_text()}
    assert found == PACKING_FROM_FOUR_ROWS, (sorted(found - PACKING_FROM_FOUR_ROWS),
                                            sorted(PACKING_FROM_FOUR_ROWS - found))

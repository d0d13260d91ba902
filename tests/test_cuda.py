"""The CUDA paths: the same checks as the CPU tests, on GPUs (nccl, CUDA kernels). Skipped with their reason on
machines without enough GPUs, where the CPU path of each is tested for real (named in each reason). Run them all,
with a report, by `bash scripts/gpu_check.sh` on a GPU machine."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.support.launcher import launch
from tests.test_parity import STEPS, _run, check_against_reference, rel_diff

GPUS = torch.cuda.device_count()
ONE_GPU = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (nccl cannot share one GPU between ranks)")
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
ATTENTION = ["sdpa"] + (["flash_attention_2"] if HAS_FLASH else [])
FLASH = pytest.mark.skipif(GPUS < 1 or not HAS_FLASH, reason="needs a CUDA GPU and flash-attn (scripts/gpu_check.sh"
                           " installs a prebuilt wheel when one exists); CPU path: tests/test_windows.py (sdpa per"
                           " document)")
CUDA = {"DS_ACCELERATOR": "cuda"}


@TWO_GPUS
@pytest.mark.parametrize("attn", ATTENTION)
def test_sp2_on_cuda_matches_single_device(attn):
    """CPU path: tests/test_parity.py (gloo, sdpa)."""
    # flash-attn has no fp32 kernels: bf16 weights and a looser tolerance for that case.
    precision = "bf16-true" if attn.startswith("flash") else "32-true"
    run = _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, attn=attn,
               trainer={"accelerator": "cuda", "precision": precision})
    results = launch(2, "parity:run", {"runs": [run]}, extra_env={"DS_ACCELERATOR": "cuda"})
    if attn == "sdpa":
        check_against_reference(dict(run, attn="sdpa"), [r["runs"][0] for r in results], global_batch=1)
    else:
        losses = [r["runs"][0]["losses"] for r in results]
        assert losses[0] == losses[1]
        assert all(torch.isfinite(torch.tensor(losses[0])))


@TWO_GPUS
@pytest.mark.parametrize("model", ["llama", "litgpt-llama"])
@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_on_cuda_matches_single_device(model, stage):
    """The Fabric front end on 2 GPUs (nccl, batches moved to the GPU by Fabric's loader), fp32, a Hugging Face and a
    LitGPT model. CPU path: tests/test_fabric.py."""
    from tests.test_fabric import _case, assert_trains_as_one_device, reference

    case = dict(_case(model, stage), accelerator="cuda")
    results = launch(2, "fabric:run", {"cases": [case]}, extra_env=CUDA)
    assert_trains_as_one_device(results, case, reference(case))


@TWO_GPUS
@pytest.mark.parametrize("stage", [2, 3])
def test_ring_on_cuda_matches_single_device(stage):
    """Ring 2 × Ulysses 1 on 2 GPUs (nccl point-to-point passes, the memory-efficient block kernel), for models built
    for sdpa and for flex attention. CPU path: tests/test_ring.py."""
    run = _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy={"ring_size": 2},
               trainer={"accelerator": "cuda", "precision": "32-true"})
    flex = dict(run, attn="flex_attention")
    results = launch(2, "parity:run", {"runs": [run, flex]}, extra_env=CUDA)
    for index, case in enumerate((run, flex)):
        check_against_reference(case, [r["runs"][index] for r in results], global_batch=1)


@TWO_GPUS
@pytest.mark.parametrize("feature", ["tiled-mlp", "tiled-loss", "offload-checkpoints", "all"])
def test_memory_features_on_cuda_match_single_device(feature):
    """Tiled MLP, tiled logits + loss, and checkpoint offload to pinned host memory (the copies are asynchronous on
    CUDA) at ZeRO 3. CPU path: tests/test_memory_features.py."""
    from tests.test_memory_features import FEATURES

    run = _run(3, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy=FEATURES[feature],
               trainer={"accelerator": "cuda", "precision": "32-true"})
    results = launch(2, "parity:run", {"runs": [run]}, extra_env=CUDA)
    check_against_reference(run, [r["runs"][0] for r in results], global_batch=1)


@TWO_GPUS
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_cuda_trains_like_fp32_within_bf16_rounding(precision):
    """bf16 under SP: the SP peers report the same loss, and the losses follow the fp32 single-device run within
    bf16 rounding (2e-2 relative; an exchange on the wrong heads or positions is off by far more). CPU path:
    tests/test_resume_layouts.py (bf16-true ZeRO 2)."""
    from tests.support.models import TokenDataset, tiny_llama_config, train_single_device
    from tests.test_parity import LR, SEQ_LEN

    run = _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS,
               trainer={"accelerator": "cuda", "precision": precision})
    results = launch(2, "parity:run", {"runs": [run]}, extra_env=CUDA)
    losses = [r["runs"][0]["losses"] for r in results]
    assert losses[0] == losses[1]
    reference = train_single_device(tiny_llama_config(num_kv_heads=2), TokenDataset(STEPS, SEQ_LEN), 1, STEPS, LR)
    assert rel_diff(losses[0], reference["losses"]) <= 2e-2, (losses[0], reference["losses"])


@TWO_GPUS
def test_from_pretrained_in_configure_model_at_zero3_on_cuda(tmp_path):
    """``from_pretrained`` inside ``configure_model`` at ZeRO 3 on GPUs: the file's weights, then the plain
    process's training. CPU path: tests/test_finetune.py."""
    from tests.support.models import build_llama, tiny_llama_config
    from tests.test_finetune import Rows, check_training, file_weights

    build_llama(tiny_llama_config(num_kv_heads=2), init_seed=3).save_pretrained(tmp_path)
    case = {"spec": {"path": str(tmp_path)}, "dataset": Rows(STEPS), "stage": 3,
            "trainer": {"accelerator": "cuda", "precision": "32-true"}}
    results = launch(2, "finetune:finetune", {"cases": {"pretrained": case}}, extra_env=CUDA)
    result = results[0]["pretrained"]
    assert "error" not in result, result.get("error")
    for name, tensor in file_weights(str(tmp_path)).items():
        assert torch.equal(result["initial"][name].cpu(), tensor), name
    check_training(result, case)


HYBRID_KERNELS = [name for name in ("fla", "mamba_ssm", "causal_conv1d") if importlib.util.find_spec(name)]


@TWO_GPUS
@pytest.mark.skipif(not HYBRID_KERNELS, reason="none of fla, mamba_ssm, causal_conv1d is installed; CPU path:"
                    " tests/test_mixers.py (transformers' torch fallbacks)")
@pytest.mark.parametrize("arch", ["qwen3_next", "bamba", "lfm2", "mamba"])
def test_hybrid_families_on_cuda_with_their_kernels(arch):
    """The hybrid families on GPUs, with whatever CUDA kernels are installed, against one device's torch fallbacks:
    losses within 1e-3 (the kernels' own chunked arithmetic differs from the fallbacks') and equal on both SP
    ranks. CPU path: tests/test_mixers.py (exact)."""
    from tests.test_steps import train_reference

    case = {"name": f"{arch}-cuda", "arch": arch, "step": "model_loss", "stage": 2, "reference": "model_loss",
            "trainer": {"accelerator": "cuda", "precision": "32-true"}}
    by_rank = launch(2, "steps:run", {"cases": [case]}, extra_env=CUDA, timeout=900)
    ranks = [r[case["name"]] for r in by_rank]
    assert ranks[0]["error_type"] is None, ranks[0]["message"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    reference = train_reference(case)
    assert rel_diff(ranks[0]["losses"], reference["losses"]) <= 1e-3, (ranks[0]["losses"], reference["losses"])


# ---------------------------------------------------------------------------------------------- one GPU, one rank
@ONE_GPU
def test_strategy_on_one_gpu_trains_as_the_plain_model(record_property):
    """The strategy's CUDA path on one GPU (sp_size=1, nccl, DeepSpeed on CUDA): fp32 at ZeRO 2 and at ZeRO 3 with
    every memory switch on (tiled MLP and loss, checkpoints offloaded to pinned host memory on a side stream), also with
    ``offload_attention`` (the layer checkpoint, the chunks in pinned host memory, the attention block run by the
    strategy) gives the plain model's losses (CPU reference, 1e-5); bf16-mixed and bf16-true follow them within
    bf16 rounding (2e-2). One launch. CPU path: tests/test_parity.py, tests/test_memory_features.py,
    tests/test_offload_attention.py (the same offload run on CPU passed when this was written)."""
    from tests.support.models import TokenDataset, tiny_llama_config, train_single_device
    from tests.test_memory_features import FEATURES
    from tests.test_parity import LR, SEQ_LEN

    fp32 = {"accelerator": "cuda", "precision": "32-true"}
    runs = {"zero2-fp32": _run(2, 2, sp_size=1, batch_size=1, num_rows=STEPS, trainer=fp32),
            "zero3-fp32-all-switches": _run(3, 2, sp_size=1, batch_size=1, num_rows=STEPS, strategy=FEATURES["all"],
                                            trainer=fp32),
            "zero3-fp32-all-switches-offload-attention": _run(3, 2, sp_size=1, batch_size=1, num_rows=STEPS,
                                                              strategy={**FEATURES["all"], "offload_attention": 8},
                                                              trainer=fp32)}
    for precision in ("bf16-mixed", "bf16-true"):
        runs[f"zero2-{precision}"] = _run(2, 2, sp_size=1, batch_size=1, num_rows=STEPS,
                                          trainer={"accelerator": "cuda", "precision": precision})
    results = launch(1, "parity:run", {"runs": list(runs.values())}, extra_env=CUDA)
    reference = train_single_device(tiny_llama_config(num_kv_heads=2), TokenDataset(STEPS, SEQ_LEN), 1, STEPS, LR)
    for index, (name, run) in enumerate(runs.items()):
        losses = results[0]["runs"][index]["losses"]
        error = rel_diff(losses, reference["losses"])
        record_property(f"{name}_loss_rel_diff", f"{error:.3g}")
        if "fp32" in name:
            check_against_reference(run, [results[0]["runs"][index]], global_batch=1)
        else:
            assert error <= 2e-2, (name, losses, reference["losses"])


@ONE_GPU
def test_tensor_memory_tracker_peak_is_the_cuda_allocators_peak(record_property):
    """What TensorMemoryTracker counts is what CUDA's ``max_memory_allocated`` grows by over a training step (a warmed
    step of a Llama at 4K tokens, fp32): within 5% (the allocator rounds blocks up; kernels' own workspaces are not
    tensors the tracker sees). CPU path: tests/profiling/test_tensor_memory.py (the tracker's own counts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_ulysses import TensorMemoryTracker

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).cuda()
    ids = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # warm-up: cuBLAS workspaces, the gradients' storages
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with TensorMemoryTracker() as tracker:
        step()
    torch.cuda.synchronize()
    cuda_growth = torch.cuda.max_memory_allocated() - base
    tracked = tracker.result().peak_bytes
    record_property("tracker_peak_mib", f"{tracked / 2**20:.1f}")
    record_property("cuda_peak_growth_mib", f"{cuda_growth / 2**20:.1f}")
    assert abs(tracked - cuda_growth) <= 0.05 * cuda_growth, (tracked, cuda_growth)


# ---------------------------------------------------------------------------------------------- one GPU, one process
def _packed_inputs(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, 48, 64, device="cuda", generator=g, dtype=dtype) for h in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 13, 14, 40, 48], dtype=torch.int32, device="cuda")  # documents of 13, 1, 26, 8
    documents = torch.repeat_interleave(torch.arange(4, device="cuda"), cu_seqlens.diff())
    return q, k, v, cu_seqlens, documents


class _Attention(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True
    training = True


def _dense_reference(q, k, v, window, documents):
    """Dense attention with the window and document masks: [B, h, L, D] -> [B, L, hq, D]."""
    L = q.shape[2]
    pos = torch.arange(L, device=q.device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - (window or L + 1))
    allowed &= documents[:, None] == documents[None, :]
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)


def _attend_and_grads(fn, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


@FLASH
@pytest.mark.parametrize("window", [None, 6])
def test_flash_varlen_keeps_packed_documents_apart(window):
    """flash_attention_2's varlen path on packed rows (documents from ``cu_seqlens``, the layer's window passed
    through): output and q/k/v gradients equal dense attention with the document (and window) mask, bf16."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lightning_ulysses.context import ShardInfo
    from lightning_ulysses.models.hf_attention import _attend_documents

    q, k, v, cu_seqlens, documents = _packed_inputs(torch.bfloat16)
    shard = ShardInfo(48, cu_seqlens, 26)
    kwargs = {"sliding_window": window} if window else {}
    dout = torch.randn(1, 48, 4, 64, device="cuda", dtype=torch.bfloat16)
    got = _attend_and_grads(lambda a, b, c: _attend_documents(
        "flash_attention_2", ALL_ATTENTION_FUNCTIONS["flash_attention_2"], _Attention(), a, b, c, shard,
        dict(kwargs), window), q, k, v, dout)
    want = _attend_and_grads(lambda a, b, c: _dense_reference(a.float(), b.float(), c.float(), window, documents),
                             q, k, v, dout)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


@ONE_GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_ring_block_kernels_on_cuda_match_sdpa(dtype, window):
    """One query block against one key block on the GPU (what ring attention runs per block): the kernel chosen on
    CUDA is torch's memory-efficient op (in float32; in bf16 the op in bf16 where it agrees with the matmul kernel,
    else on float32 copies: on torch 2.11 + H200 its bf16 backward disagreed), and both it and the matmul fallback
    give SDPA's output and q/k/v gradients from the final log-sum-exp. CPU path: tests/test_ring.py (fused and
    matmul)."""
    from lightning_ulysses.parallel.ring import _block_backward, _block_forward, block_kernel, causal_window_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 72, 16, device="cuda", generator=g, dtype=dtype) for _ in range(3))
    chosen = block_kernel(q)
    assert chosen == "cuda_efficient" if dtype == torch.float32 else chosen in ("cuda_efficient", "cuda_efficient_fp32")
    pos = torch.arange(72, device="cuda")
    mask = causal_window_mask(pos, pos, window)
    qr, kr, vr = (t.float().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=0.25)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for kernel in (chosen, "matmul"):
        kd = dtype if kernel != "matmul" else torch.float32
        out, lse = _block_forward(q.to(kd), k.to(kd), v.to(kd), False, mask, 0.25, kernel)
        dq, dk, dv = _block_backward(dout.to(kd), q.to(kd), k.to(kd), v.to(kd), out, lse.float(), False, mask, 0.25,
                                     kernel)
        for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
            assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), kernel


@ONE_GPU
def test_offloaded_attention_on_cuda_is_exact_and_leaves_the_device(record_property):
    """``offload_attention``'s chunked attention on CUDA (the memory-efficient block kernel, chunks in pinned host
    memory copied on a side stream, fetched one chunk ahead in backward): output and gradients equal full attention
    (float32, 1e-4), and between forward and backward the device holds the output only, not the chunks' q, k, v,
    outputs and log-sum-exps (what a flash kernel keeps on the device). CPU path: tests/test_offload_attention.py
    (the chunks stay in place there)."""
    from lightning_ulysses.parallel.offload_attention import offloaded_attention

    class Module:
        training = True

    torch.manual_seed(0)
    B, hq, hkv, S, D = 1, 8, 2, 8192, 64
    q, k, v = (torch.randn(B, h, S, D, device="cuda", requires_grad=True) for h in (hq, hkv, hkv))
    grad = torch.randn(B, S, hq, D, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = offloaded_attention(Module(), q, k, v, 1024, None, {"scaling": D ** -0.5})
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before  # the output, and nothing the backward pass needs
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                              is_causal=True).transpose(1, 2)
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    record_property("kept_after_forward_mib", f"{kept / 2**20:.1f}")
    assert kept <= 1.05 * out.numel() * out.element_size(), kept
    for a, b in zip((out, *got), (want_out, *want)):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-5


@ONE_GPU
def test_offloaded_attention_on_cuda_keeps_the_allocator_reserve_small_over_layers(record_property):
    """Eight layers of ``offload_attention`` in bf16 (every output kept to the end, as a model without checkpointing
    keeps its activations), then their backward: the caching allocator reserves at most half of the peak it
    allocates on top (the copy window bounds the device chunks waiting for their copies to the host; before it, an
    H100 sweep reserved 37.7 GB over a 42.0 GB peak, plain attention 4.0 GB), and output and gradients follow SDPA's
    within bf16 rounding. CPU path: tests/test_offload_attention.py (the window's rule, the chunking's exactness)."""
    from lightning_ulysses.parallel.offload_attention import offloaded_attention

    class Module:
        training = True

    torch.manual_seed(0)
    B, hq, hkv, S, D, layers = 1, 16, 4, 16384, 128, 8
    inputs = [[torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv)]
              for _ in range(layers)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = [offloaded_attention(Module(), q, k, v, 4096, None, {"scaling": D ** -0.5}) for q, k, v in inputs]
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - base
    reserve = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
    record_property("peak_allocated_mib", f"{allocated / 2**20:.0f}")
    record_property("reserve_over_peak_mib", f"{reserve / 2**20:.0f}")
    assert reserve <= 0.5 * allocated, (reserve, allocated)
    q, k, v = inputs[0]
    want_out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                              is_causal=True).transpose(1, 2)
    want = torch.autograd.grad(want_out, (q, k, v), grads[0])
    for got, expected in zip((outs[0], q.grad, k.grad, v.grad), (want_out, *want)):
        assert (got.float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()


@ONE_GPU
def test_layer_checkpoint_on_cuda_moves_the_recompute_to_the_host(record_property):
    """``offload_attention``'s layer checkpoint on CUDA (offload/layer_checkpoint.py): the recompute's saved tensors
    and the incoming gradient wait in pinned host memory, the recomputed layer's input and output storages are freed,
    the rotary embedding runs in tiles. A 4-layer bf16 Llama (hidden 1024, 16 heads of 64, 4 KV heads, SDPA) at 32K
    tokens with the tiled MLP and offloaded checkpoints: loss and gradients equal torch's checkpoint with the same
    switches (within bf16 rounding), and the step's allocated peak is lower. CPU path:
    tests/offload/test_layer_checkpoint.py."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_ulysses.models import memory

    config = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
                                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                  max_position_embeddings=65536, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (1, 32768), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for name, offload in (("torch", False), ("strategy", True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
        memory.enable(model, memory.MemoryFeatures("auto", 0, True, ulysses_offload=offload), None)
        model(input_ids=ids[:, :1024], labels=ids[:, :1024]).loss.backward()  # warm-up: kernels, the rotary check
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        results[name] = (float(loss), [p.grad.float() for p in model.parameters()],
                         torch.cuda.max_memory_allocated() - base)
        memory.disable(model)
        del model
    (want_loss, want, torch_peak), (loss, got, strategy_peak) = results["torch"], results["strategy"]
    record_property("torch_checkpoint_peak_mib", f"{torch_peak / 2**20:.0f}")
    record_property("layer_checkpoint_peak_mib", f"{strategy_peak / 2**20:.0f}")
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max().clamp_min(1e-6)
    assert strategy_peak < torch_peak, (strategy_peak, torch_peak)


# last: flex_attention compiles its kernels, about 110 s a case on an H100 (the rest of this file: about 50 s)
@ONE_GPU
@pytest.mark.parametrize("window", [None, 6])
def test_flex_document_and_window_masks(window):
    """flex_attention with the strategy's block masks on packed rows and on one sequence (window on global
    positions): output and q/k/v gradients equal dense attention with the same masks. CPU path:
    tests/test_windows.py (the same structure with sdpa)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lightning_ulysses.context import ShardInfo
    from lightning_ulysses.models.hf_attention import _attend_documents, _flex_block_mask

    q, k, v, cu_seqlens, documents = _packed_inputs(torch.float32)
    flex = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    dout = torch.randn(1, 48, 4, 64, device="cuda")
    packed = _attend_and_grads(lambda a, b, c: _attend_documents(
        "flex_attention", flex, _Attention(), a, b, c, ShardInfo(48, cu_seqlens, 26), {}, window), q, k, v, dout)
    want = _attend_and_grads(lambda a, b, c: _dense_reference(a, b, c, window, documents), q, k, v, dout)
    one_sequence = _attend_and_grads(lambda a, b, c: flex(_Attention(), a, b, c,
                                                          _flex_block_mask(48, q.device, None, window))[0],
                                     q, k, v, dout)
    want_one = _attend_and_grads(lambda a, b, c: _dense_reference(a, b, c, window, torch.zeros_like(documents)),
                                 q, k, v, dout)
    for a, b in list(zip(packed, want)) + list(zip(one_sequence, want_one)):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()

"""The CUDA paths: the same checks as the CPU tests, on GPUs (nccl, CUDA kernels). Skipped with their reason on
machines without enough GPUs, where the CPU path of each is tested for real (named in each reason). Run them all,
with a report, by `bash scripts/gpu_check.sh` on a GPU machine."""

import importlib.util

import pytest
import torch

from tests.launcher import launch
from tests.test_parity import STEPS, _run, check_against_reference

GPUS = torch.cuda.device_count()
ONE_GPU = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (nccl cannot share one GPU between ranks)")
ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@TWO_GPUS
@pytest.mark.parametrize("attn", ATTENTION)
def test_sp2_on_cuda_matches_single_device(attn):
    """CPU path: tests/test_parity.py (gloo, sdpa)."""
    # flash-attn has no fp32 kernels: bf16 weights and a looser tolerance for that case.
    precision = "bf16-true" if attn.startswith("flash") else "32-true"
    run = _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, attn=attn,
               trainer={"accelerator": "cuda", "precision": precision})
    results = launch(2, "parity", {"runs": [run]}, extra_env={"DS_ACCELERATOR": "cuda"})
    if attn == "sdpa":
        check_against_reference(dict(run, attn="sdpa"), [r["runs"][0] for r in results], global_batch=1)
    else:
        losses = [r["runs"][0]["losses"] for r in results]
        assert losses[0] == losses[1]
        assert all(torch.isfinite(torch.tensor(losses[0])))


@TWO_GPUS
@pytest.mark.parametrize("stage", [2, 3])
def test_ring_on_cuda_matches_single_device(stage):
    """Ring 2 × Ulysses 1 on 2 GPUs (nccl point-to-point passes, the matmul block kernel). CPU path:
    tests/test_ring.py."""
    run = _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy={"ring_size": 2},
               trainer={"accelerator": "cuda", "precision": "32-true"})
    results = launch(2, "parity", {"runs": [run]}, extra_env={"DS_ACCELERATOR": "cuda"})
    check_against_reference(run, [r["runs"][0] for r in results], global_batch=1)


@ONE_GPU
@pytest.mark.parametrize("window", [None, 5])
def test_ring_block_kernel_on_cuda_matches_sdpa(window):
    """One query block against one key block on the GPU (the kernel ring attention runs per block there): output and
    q/k/v gradients from the final log-sum-exp equal SDPA's. CPU path: tests/test_ring.py (fused and matmul)."""
    from lightning_ulysses.ring import _block_backward, _block_forward, causal_window_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, device="cuda", generator=g) for _ in range(3))
    pos = torch.arange(64, device="cuda")
    mask = causal_window_mask(pos, pos, window)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=0.25)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, lse = _block_forward(q, k, v, False, mask, 0.25, fused=False)
    dq, dk, dv = _block_backward(dout, q, k, v, out, lse, False, mask, 0.25, fused=False)
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)

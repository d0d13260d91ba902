"""The same parity on CUDA (nccl) with flash-attention and sdpa kernels. Needs 2 GPUs (and flash-attn for the
flash case); skipped on CPU machines, where tests/test_parity.py covers the same code path with gloo and sdpa."""

import importlib.util

import pytest
import torch

from tests.launcher import launch
from tests.test_parity import STEPS, _run, check_against_reference

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl); CPU path: test_parity")

ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("attn", ATTENTION)
def test_sp2_on_cuda_matches_single_device(attn):
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

"""The model-form check's bound follows the precision the model computes in, not its output's dtype: a bf16 model
whose head upcasts its logits (Mamba's ``logits.float()``) gets bf16's bound (the check stopped exact bf16 Mamba and
FalconMamba runs at 6e-3 against float32's 1e-4: the causal-LM sweep's bf16 column found it)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_ulysses.models.form_check import model_tolerance, tolerance


class UpcastingHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).float()


def test_a_bf16_model_with_float32_output_gets_bf16s_bound():
    model = UpcastingHead().to(torch.bfloat16)
    output = model(torch.ones(1, 4, dtype=torch.bfloat16))
    assert output.dtype == torch.float32
    assert model_tolerance(model, output) == tolerance(torch.bfloat16) > tolerance(torch.float32)


def test_a_float32_model_keeps_float32s_bound():
    model = UpcastingHead()
    assert model_tolerance(model, model(torch.ones(1, 4))) == tolerance(torch.float32)
    # a float32 model's 16-bit output (an own cast) is judged as 16-bit
    assert model_tolerance(model, torch.ones(2, dtype=torch.float16)) == tolerance(torch.float16)

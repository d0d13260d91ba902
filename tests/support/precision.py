"""Precision references shared by the bf16 tests (``tests/test_bf16.py``) and the sweep's bf16 column
(``tests/support/sweep.py``): one device trained in a given dtype as DeepSpeed would (bf16 weights with float32
master weights, and Adam's float32 moments), and the errors of a run against a float64 one."""

from __future__ import annotations

import torch


def sgd_in_dtype(module, trainable, loss_of_step, lr: float, dtype: torch.dtype, optimizer: str = "sgd",
                 steps: int = 3, buffers_too: bool = True) -> dict:
    """Plain SGD (or Adam) on one device with ``module`` in ``dtype``; bf16 keeps float32 master weights, and Adam
    float32 moments, as DeepSpeed does. ``buffers_too=False``: only the parameters are cast, the buffers keep their
    dtype, as DeepSpeed's bf16 mode casts a module (``precision="bf16-mixed"``, or bf16 in the DeepSpeed config;
    DeepSpeed 0.19 keeps float32 buffers such as rotary ``inv_freq``); Lightning's ``bf16-true`` casts both."""
    if buffers_too:
        module.to(dtype)
    else:
        for p in module.parameters():
            p.data = p.data.to(dtype)
    initial = {k: p.detach().double().clone() for k, p in trainable(module).items()}
    master = {k: p.detach().float().clone() if dtype == torch.bfloat16 else p for k, p in trainable(module).items()}
    adam = torch.optim.Adam(list(master.values()), lr=lr) if optimizer == "adam" else None
    losses = []
    for step in range(steps):
        loss = loss_of_step(module, step)
        loss.backward()
        with torch.no_grad():
            for name, p in trainable(module).items():
                if p.grad is not None and master[name] is not p:
                    master[name].grad = p.grad.float()
            if adam is not None:
                adam.step()
            else:
                for weights in master.values():
                    if weights.grad is not None:
                        weights -= lr * weights.grad
            for name, p in trainable(module).items():
                if master[name] is not p:
                    p.copy_(master[name])
                    master[name].grad = None
                p.grad = None
        losses.append(float(loss.detach()))
    return {"losses": losses, "initial": initial,
            "weights": {k: p.detach().double().clone() for k, p in trainable(module).items()}}


def loss_error(losses: list[float], exact: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(losses, exact))


def update_error(weights: dict, initial: dict, exact: dict) -> float:
    """|Δw - Δw_exact| / |Δw_exact| over every trained parameter (Δ from each run's own initial weights)."""
    num = den = 0.0
    for name, final in exact["weights"].items():
        want = final - exact["initial"][name]
        got = weights[name].double() - initial[name]
        num += float(((got - want) ** 2).sum())
        den += float((want ** 2).sum())
    return (num / den) ** 0.5

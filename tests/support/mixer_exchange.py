"""What the mixer-exchange tests share (``tests/test_mixer_exchange.py``): mixers of every family at a width where
bytes can be compared with attention's, a counter of the bytes the SP exchange sends, the byte count of an attention
layer, and one mixer layer run sharded against itself whole.

Bytes are counted per rank with ring accounting, on every collective of :mod:`lightning_ulysses.parallel.exchange`
(the only place the SP exchange's collectives are written): an all-to-all sends what it sends to the other ranks
(``(sp - 1)/sp`` of its input when even), an all-gather and a reduce-scatter ``(sp - 1)/sp`` of the full tensor, an
all-reduce twice that.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses.parallel import exchange

# Mixers with their heads' width equal to the hidden size (Mamba: expand 2, as the checkpoints), 4 heads or more so
# that sp = 4 splits them: (architecture of tests/support/architectures.py, config overrides).
WIDE = 256
_GDN = dict(hidden_size=WIDE, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64)
_MAMBA2 = dict(hidden_size=WIDE, mamba_n_heads=8, mamba_d_head=64, mamba_expand=2, mamba_d_state=16,
               mamba_chunk_size=64)
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "gated delta net (qwen3_5)": ("qwen3_5_text", _GDN),
    "gated delta net (qwen3_next)": ("qwen3_next", _GDN),
    "gated delta net (olmo_hybrid)": ("olmo_hybrid", _GDN),
    "Kimi delta attention": ("kimi_linear", dict(hidden_size=WIDE, linear_num_heads=8, linear_head_dim=32)),
    "lightning attention (minimax)": ("minimax", dict(hidden_size=WIDE, num_attention_heads=4, num_key_value_heads=4,
                                                      head_dim=64)),
    "short convolution (lfm2)": ("lfm2", dict(hidden_size=WIDE)),
    "Mamba2 (bamba)": ("bamba", _MAMBA2),
    "Mamba2 (falcon_h1, gated norm)": ("falcon_h1", dict(_MAMBA2, mamba_d_ssm=2 * WIDE, mamba_rms_norm=True)),
    "Mamba2 (falcon_h1, no norm)": ("falcon_h1", dict(_MAMBA2, mamba_d_ssm=2 * WIDE, mamba_rms_norm=False)),
    # Mamba1's x_proj all-reduce is [B, S, dt_rank + 2·state] whole: at mamba-130m's width (768) as the checkpoints
    "Mamba1 (mamba)": ("mamba", dict(hidden_size=768, intermediate_size=1536, state_size=16)),
}
# The families whose bytes stay within 1.25× attention's (the norm-less Falcon-H1 exchanges its inline gate).
WITHIN_ATTENTION = [name for name in FAMILY_CONFIGS if "no norm" not in name]
# Narrow mixers for the saved-tensor check: a long sequence at a small width (activations outgrow the weights).
NARROW_CONFIGS: dict[str, tuple[str, dict]] = {
    "gated delta net (qwen3_5)": ("qwen3_5_text", dict(hidden_size=128, linear_num_key_heads=4,
                                                       linear_num_value_heads=4, linear_key_head_dim=32,
                                                       linear_value_head_dim=32)),
    "short convolution (lfm2)": ("lfm2", dict(hidden_size=128)),
    "Mamba2 (bamba)": ("bamba", dict(hidden_size=128, mamba_n_heads=8, mamba_d_head=32, mamba_expand=2,
                                     mamba_d_state=16, mamba_chunk_size=64)),
}


def mixer_of(arch: str, overrides: dict, seed: int = 0) -> tuple[nn.Module, Any]:
    """The first sequence mixer of a 2-layer model of ``arch`` of ``tests/support/architectures.py`` with
    ``overrides`` given to its config's constructor (derived sizes follow them), and the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_ulysses.models.mixers import find_sequence_mixers
    from tests.support.architectures import ARCHITECTURES, BASE

    entry = ARCHITECTURES[arch]
    settings = {k: v for k, v in {**BASE, **entry.get("config", {}), **overrides}.items() if v is not None}
    config = AutoConfig.for_model(entry["type"], **settings)
    config.use_cache = False
    torch.manual_seed(seed)
    attn = entry.get("attn", "sdpa")
    model = AutoModelForCausalLM.from_config(config, **({"attn_implementation": attn} if attn else {}))
    return find_sequence_mixers(model, lambda m: False)[0], config


def _ring_bytes(op: str, tensor: torch.Tensor, group: Any, splits: Any = None) -> int:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    size = tensor.numel() * tensor.element_size()
    if op == "all_to_all":
        if splits is None:
            return size * (n - 1) // n
        row = size // max(sum(splits), 1)
        return (sum(splits) - splits[me]) * row
    if op == "all_gather":
        return size * (n - 1)  # (n - 1)/n of the gathered tensor
    if op == "reduce_scatter":
        return size * (n - 1) // n
    return 2 * size * (n - 1) // n  # all_reduce


class _CountingDist:
    """``torch.distributed`` as :mod:`lightning_ulysses.parallel.exchange` sees it, counting what its collectives
    send."""

    def __init__(self, real: Any, sent: Counter) -> None:
        self._real, self._sent = real, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_to_all_single(self, out, x, output_splits=None, input_splits=None, group=None, **kwargs):
        self._sent["all_to_all"] += _ring_bytes("all_to_all", x, group, input_splits)
        return self._real.all_to_all_single(out, x, output_splits, input_splits, group=group, **kwargs)

    def all_gather_into_tensor(self, out, x, group=None, **kwargs):
        self._sent["all_gather"] += _ring_bytes("all_gather", x, group)
        return self._real.all_gather_into_tensor(out, x, group=group, **kwargs)

    def reduce_scatter_tensor(self, out, x, group=None, **kwargs):
        self._sent["reduce_scatter"] += _ring_bytes("reduce_scatter", x, group)
        return self._real.reduce_scatter_tensor(out, x, group=group, **kwargs)

    def all_reduce(self, x, group=None, **kwargs):
        self._sent["all_reduce"] += _ring_bytes("all_reduce", x, group)
        return self._real.all_reduce(x, group=group, **kwargs)


@contextmanager
def counting_exchange_bytes(enabled: Any = True) -> Iterator[Counter]:
    """Bytes this rank sends through the SP exchange inside the block, by collective (``enabled``: a callable that
    says, per call, whether to count it, e.g. not while the model-form check's probe runs)."""
    sent: Counter = Counter()
    real = exchange.dist
    counting = _CountingDist(real, sent)

    class _Switch:
        def __getattr__(self, name: str) -> Any:
            on = enabled() if callable(enabled) else enabled
            return getattr(counting if on else real, name)

    exchange.dist = _Switch()  # type: ignore[assignment]
    try:
        yield sent
    finally:
        exchange.dist = real


def attention_layer_bytes(hidden: int, head_dim: int, seq_len: int, batch: int = 1) -> int:
    """Bytes one rank sends for one MHA layer of ``hidden`` (q, k, v, o of that width): forward and backward of
    Ulysses attention's two all-to-alls, measured on the exchange itself."""
    from lightning_ulysses.parallel.exchange import head_to_sequence_shards, sequence_to_head_shards

    sp = dist.get_world_size()
    heads, s = hidden // head_dim, seq_len // sp
    q, k, v = (torch.randn(batch, heads, s, head_dim, requires_grad=True) for _ in range(3))
    with counting_exchange_bytes() as sent:
        hq, hk, hv = sequence_to_head_shards(q, k, v, dist.group.WORLD)  # [B, h, S, D]
        out = (hq + hk + hv).transpose(1, 2)  # [B, S, h, D]
        back = head_to_sequence_shards(out.contiguous(), dist.group.WORLD, heads)  # [B, s, H, D]
        back.sum().backward()
    return sum(sent.values())


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _call_kwargs(mixer: nn.Module) -> dict:
    return {"position_embeddings": None, "attention_mask": None} if hasattr(mixer, "slope_rate") else {}


def sharded_layer_run(mixer: nn.Module, hidden: int, seq_len: int, documents: Any = None,
                      record_saved: bool = False) -> dict:
    """``mixer`` on a ``[1, seq_len, hidden]`` input sharded over the world group (the exchange of
    :mod:`lightning_ulysses.models.mixers`) against itself whole on the same input (per document when
    ``documents`` gives their lengths): the output and every gradient's largest relative difference, the bytes this
    rank sent by collective, the warnings, and with ``record_saved`` the largest tensor storage autograd saved (bytes,
    activations: parameters left out)."""
    import warnings

    from lightning_ulysses.context import ShardInfo
    from lightning_ulysses.models.mixers import unwrap_sequence_mixer, wrap_sequence_mixer
    from lightning_ulysses.training.step_context import StepContext

    rank, sp = dist.get_rank(), dist.get_world_size()
    s = seq_len // sp
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(1, seq_len, hidden, generator=generator)
    upstream = torch.randn(1, seq_len, hidden, generator=generator)
    kwargs = _call_kwargs(mixer)

    x = full.clone().requires_grad_()
    if documents is None:
        reference = _first(mixer(x, **kwargs))
    else:
        pieces = x.split(list(documents), dim=1)
        reference = torch.cat([_first(mixer(piece, **kwargs)) for piece in pieces], dim=1)
    (reference * upstream).sum().backward()
    expected = {"output": reference.detach()[:, rank * s:(rank + 1) * s],
                "input_grad": x.grad[:, rank * s:(rank + 1) * s]}
    expected.update({name: p.grad.clone() for name, p in mixer.named_parameters() if p.grad is not None})
    mixer.zero_grad(set_to_none=True)

    world = dist.group.WORLD
    cu_seqlens = None
    if documents is not None:
        cu_seqlens = torch.tensor([0, *torch.tensor(list(documents)).cumsum(0).tolist()], dtype=torch.int32)
    context = StepContext(sp_group=world, ulysses_group=world, ring_group=world,
                          shard_info=ShardInfo(seq_len=seq_len, cu_seqlens=cu_seqlens))
    wrap_sequence_mixer(mixer, context)
    parameters = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    saved: dict[int, tuple[int, tuple]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape))
        return t

    shard = full[:, rank * s:(rank + 1) * s].clone().requires_grad_()
    try:
        with warnings.catch_warnings(record=True) as caught, counting_exchange_bytes() as sent:
            warnings.simplefilter("always")
            if record_saved:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    output = _first(mixer(shard, **kwargs))
            else:
                output = _first(mixer(shard, **kwargs))
            (output * upstream[:, rank * s:(rank + 1) * s]).sum().backward()
    finally:
        unwrap_sequence_mixer(mixer)
    got = {"output": output.detach(), "input_grad": shard.grad}
    for name, p in mixer.named_parameters():
        if p.grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad)  # every rank's part: its positions' rows, its heads' channels
            got[name] = grad
    differences = {name: float((got[name] - want).abs().max() / want.abs().max().clamp_min(1e-12))
                   for name, want in expected.items()}
    largest = max(saved.values(), default=(0, ()))
    return {"differences": differences, "missing": sorted(set(expected) - set(got)), "sent": dict(sent),
            "warnings": [str(w.message) for w in caught], "largest_saved": largest}

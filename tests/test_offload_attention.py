"""Ulysses-Offload (``offload_attention``): attention over chunks of the gathered sequence.

* in process: the chunked attention against full attention (forward and backward), causal, sliding windows, packed
  documents, GQA, chunk sizes from 1 position to more than the sequence: float64 within 1e-10, float32 within 1e-5;
  bad settings and unsupported attentions refused before compute;
* launches of 2 and 4 processes: the exchange per chunk alone against full attention (float64, 1e-12);
* launches of 2 processes: training with ``offload_attention`` is the single device's training (the sweep's
  models and comparison: per-step losses and weight updates) for a GQA Llama and a sliding-window Mistral at ZeRO 2,
  partitioned ZeRO 3 and with packed rows, and a hybrid (Qwen3-Next's attention layers) at ZeRO 2 and 3.

On CPU there is no host to offload to: the chunks stay where they are (``ChunkStore``); the CUDA copies are checked
by ``tests/test_cuda.py`` when a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.parallel.offload_attention import AUTO_CHUNK, ChunkStore, chunk_length, offloaded_attention
from lightning_ulysses.parallel.ring import causal_window_mask
from tests.support import sweep
from tests.support.launcher import launch


class _Module:
    training = True


def _reference(q, k, v, window, documents):
    groups = q.shape[1] // k.shape[1]
    S = q.shape[2]
    pos = torch.arange(S)
    allowed = causal_window_mask(pos, pos, window)  # [S, S]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]  # [B, 1, S, S]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=allowed)
    return out.transpose(1, 2)  # [B, S, hq, D]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_chunked_attention_is_full_attention(dtype, tolerance):
    torch.manual_seed(0)
    B, hq, hkv, S, D = 2, 4, 2, 37, 8
    documents = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * 37])
    worst = 0.0
    for window in (None, 5, 12):
        for docs in (None, documents):
            for chunk in (1, 6, 16, 37, 64):
                q, k, v = (torch.randn(B, h, S, D, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
                grad = torch.randn(B, S, hq, D, dtype=dtype)
                got = offloaded_attention(_Module(), q, k, v, chunk, window, {"scaling": D ** -0.5}, docs)
                got_grads = torch.autograd.grad(got, (q, k, v), grad)
                want = _reference(q, k, v, window, docs)
                want_grads = torch.autograd.grad(want, (q, k, v), grad)
                for a, b in zip((got, *got_grads), (want, *want_grads)):
                    worst = max(worst, (a - b).abs().max().item())
                assert worst <= tolerance, (window, docs is not None, chunk, worst)


def test_settings_are_checked_before_anything_is_built():
    assert chunk_length(False) is None and chunk_length(True) == chunk_length("auto") == AUTO_CHUNK
    assert chunk_length(512) == 512
    for bad in (-1, 0.5, "big"):
        with pytest.raises(ValueError, match="offload_attention="):
            UlyssesDeepSpeedStrategy(sp_size=2, offload_attention=bad)
    with pytest.raises(ValueError, match="offload_attention with ring_size > 1 is not supported"):
        UlyssesDeepSpeedStrategy(sp_size=4, ring_size=2, offload_attention=True)
    with pytest.raises(ValueError, match="soft-capping is not supported with offload_attention"):
        q = torch.zeros(1, 2, 4, 8)
        offloaded_attention(_Module(), q, q, q, 2, None, {"softcap": 30.0})


def test_the_store_keeps_chunks_in_place_without_a_host():
    chunk = torch.randn(3, 4)
    store = ChunkStore(torch.device("cpu"))
    assert not store.offloads and store.ready(store.fetch(store.put(chunk))) is chunk


class _FakeCopy:
    """A device-to-host copy's event: done once ``finished`` says so; ``synchronize()`` waits it out."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.finished = name, log, False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.finished = True


def test_the_copy_window_holds_the_host_to_its_limit_of_copies_in_flight():
    """On CUDA every stored chunk's copy to the host goes through one window per device: past its limit the host
    waits for the oldest copy (a device tensor handed to a copy is reusable only once the copy stream gets there, so
    a host running ahead would keep every layer's chunks reserved; measured on an H100, docs/ulysses-offload.md).
    Copies already done are dropped without waiting. The CUDA side: tests/test_cuda.py."""
    from lightning_ulysses.parallel.offload_attention import CopyWindow

    waited: list[str] = []
    window = CopyWindow(limit=2)
    copies = [_FakeCopy(f"c{i}", waited) for i in range(5)]
    window.add(copies[0])
    window.add(copies[1])
    assert waited == [] and len(window.events) == 2
    window.add(copies[2])  # one past the limit: the oldest is waited for
    assert waited == ["c0"] and [e.name for e in window.events] == ["c1", "c2"]
    copies[1].finished = True  # finished on its own: dropped, no wait
    window.add(copies[3])
    assert waited == ["c0"] and [e.name for e in window.events] == ["c2", "c3"]
    window.add(copies[4])
    assert waited == ["c0", "c2"] and [e.name for e in window.events] == ["c3", "c4"]


ALONE = [  # the exchange per chunk alone, float64, at 2 and 4 ranks: each rank's shard against full attention
    {"name": "gqa", "B": 2, "Hq": 4, "Hkv": 2, "S": 48, "D": 8, "chunk": 12},
    {"name": "mha_odd_chunks", "B": 1, "Hq": 4, "Hkv": 4, "S": 40, "D": 8, "chunk": 6},
    {"name": "window", "B": 1, "Hq": 4, "Hkv": 2, "S": 48, "D": 8, "chunk": 8, "window": 7},
    {"name": "packed", "B": 2, "Hq": 4, "Hkv": 2, "S": 48, "D": 8, "chunk": 16, "document_starts": [5, 6, 19, 30]},
    {"name": "one_chunk", "B": 1, "Hq": 4, "Hkv": 2, "S": 32, "D": 8, "chunk": 64},
]


@pytest.fixture(scope="module")
def alone():
    return {n: launch(n, "offload_attention:alone", {"cases": ALONE}) for n in (2, 4)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", [c["name"] for c in ALONE])
def test_the_exchange_per_chunk_is_exact_in_float64(alone, ranks, name):
    """Each rank's piece ``i`` exchanged alone makes global chunk ``i`` (``sp`` runs spread over the sequence); the
    blocks' masks on global positions make it full causal (windowed, per-document) attention: the output and every
    gradient (the keys' and values' from every rank's queries) within 1e-12 of full attention."""
    worst = max(max(rank[name].values()) for rank in alone[ranks])
    assert worst <= 1e-12, (ranks, name, alone[ranks][0][name])


CASES = {"llama": ("zero2", "zero3", "packed"), "mistral": ("zero2", "zero3", "packed"),
         "qwen3_next": ("zero2", "zero3")}  # Qwen3-Next's own forward mixes packed documents: no packed reference
CHUNK = 8  # positions per chunk: the sweep's 32-token rows in 4 chunks


@pytest.fixture(scope="module")
def trained():
    classes = sweep.causal_lm_classes()
    results = {}
    for settings in (["zero2", "zero3"], ["packed"]):
        models = {m: classes[m] for m, wanted in CASES.items() if settings[0] in wanted}
        by_rank = launch(2, "causal_lm_sweep:run", {"models": models, "steps": sweep.STEPS, "settings": settings,
                                                    "strategy": {"offload_attention": CHUNK},
                                                    "model_timeout": 120}, timeout=300)
        results.update({(m, s): [r[f"{m}@{s}"] for r in by_rank] for m in models for s in settings})
    return results


# With the ALST switches (the combination the longest sequence is planned for): the decoder layers run through the
# strategy's own checkpoint (offload/layer_checkpoint.py: no graph in the first forward, the recompute's saved tensors
# in host memory on CUDA), the attention block run by the strategy itself (offload/attention_block.py) with the
# rotary embedding in tiles of positions (offload/rotary_tiles.py), here 6 positions a
# tile (a query position is 4 heads of 16 float32: 256 bytes) so that the 16-position shards are cut unevenly.
WITH_ALST = {"llama": ("zero3", "packed", "bf16"), "mistral": ("zero3", "packed"),
             "qwen3": ("zero3", "bf16"), "qwen2": ("zero3",)}  # every family with an owned attention block  # (Qwen3: its q/k norms tiled with the MLP) a hybrid's layers: in process
# (bf16: Lightning's bf16-mixed at ZeRO 2, its error against float64 at most the sweep's BF16_RATIO times one bf16
# device's)
# (tests/offload/test_layer_checkpoint.py); ZeRO 2 with this switch alone above
ALST_SWITCHES = {"offload_attention": CHUNK, "tiled_mlp": 3, "offload_checkpoints": True}


@pytest.fixture(scope="module")
def trained_with_alst():
    classes = sweep.causal_lm_classes()
    settings = sorted({setting for wanted in WITH_ALST.values() for setting in wanted})
    models = {m: classes[m] for m in WITH_ALST}
    by_rank = launch(2, "causal_lm_sweep:run", {"models": models, "steps": sweep.STEPS, "settings": settings,
                                                "strategy": ALST_SWITCHES, "rotary_tile_bytes": 1600,
                                                "model_timeout": 120}, timeout=400)
    results = {(m, s): [r[f"{m}@{s}"] for r in by_rank] for m in models for s in settings}
    # the CUDA paths with a GPU's host copies emulated (benchmarks/host_emulation.py): the recompute's saved tensors
    # and the chunks leave the "device", the parked gradient
    on_host = {m: classes[m] for m in EMULATED_HOST}
    by_rank = launch(2, "causal_lm_sweep:run", {"models": on_host, "steps": sweep.STEPS, "settings": ["zero3"],
                                                "strategy": ALST_SWITCHES, "rotary_tile_bytes": 1600,
                                                "emulate_host": True, "model_timeout": 120}, timeout=400)
    results.update({(m, "zero3 host"): [r[f"{m}@zero3"] for r in by_rank] for m in on_host})
    return results


EMULATED_HOST = ("llama",)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type,setting", [(m, s) for m, settings in WITH_ALST.items() for s in settings]
                         + [(m, "zero3 host") for m in EMULATED_HOST])
def test_training_with_offloaded_attention_and_the_alst_switches_is_one_devices(trained_with_alst, model_type,
                                                                                 setting):
    reference = sweep.train_reference(model_type, setting=setting.split()[0])
    got = sweep.classify(model_type, reference, trained_with_alst[(model_type, setting)], setting)
    owned = [rank["owned_attention_calls"] for rank in trained_with_alst[(model_type, setting)]]
    if setting == "bf16":  # against float64, as a ratio to one bf16 device's error
        measured = f"loss {got.get('loss_ratio', float('nan')):.2f}x, update {got.get('update_ratio', float('nan')):.2f}x"
    else:
        measured = f"loss {got.get('loss_diff', float('nan')):.1e}, update {got.get('update_diff', float('nan')):.1e}"
    print(f"[measured] {model_type} {setting} + ALST: {measured}, owned attention blocks run {owned}")
    assert got["outcome"] == sweep.EXACT, got
    # the strategy ran every layer's attention block itself (offload/attention_block.py; the family is registered):
    # 2 layers, each in its first forward (no graph) and its recompute, every step (and in the model-form check's
    # probe, whole and sharded: 16 or 20 here)
    assert owned[0] == owned[1] >= 2 * 2 * sweep.STEPS, owned


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_type,setting", [(m, s) for m, settings in CASES.items() for s in settings])
def test_training_with_offloaded_attention_is_one_devices(trained, model_type, setting):
    reference = sweep.train_reference(model_type, setting=setting)
    got = sweep.classify(model_type, reference, trained[(model_type, setting)], setting)
    print(f"[measured] {model_type} {setting}: loss {got.get('loss_diff', float('nan')):.1e}, update"
          f" {got.get('update_diff', float('nan')):.1e}")
    assert got["outcome"] == sweep.EXACT, got

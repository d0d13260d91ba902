"""Hybrid Ulysses × ring sequence parallelism (``ring_size``): ring attention alone is exact in float64 (forward and
backward, ≤ 1e-10), and training with ring groups is the single device's training (per-step losses and weight
updates, relative 1e-5): 2×2 and 1×4 at ZeRO 2 and 3 (MHA and MQA), a 2-head model at sp=4 (impossible with Ulysses
alone), dp2 × (1 Ulysses × 2 ring), right-padded micro-batches with validation and gathered predictions."""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import VarLenDataset, pad_right_collate, tiny_llama_config, train_on_batches
from tests.support.training import FitSpec
from tests.test_parity import LR, REL_TOL, SEQ_LEN, STEPS, check_against_reference, rel_diff, update_rel_diff

RING_CASES = [  # the fused CPU kernel (torch's flash-attention-for-CPU op) unless "kernel": "matmul" (the fallback)
    {"name": "mha_r4", "B": 2, "Hq": 4, "Hkv": 4, "S": 32, "D": 8},
    {"name": "gqa_r4_odd_len", "B": 1, "Hq": 4, "Hkv": 2, "S": 24, "D": 8},
    {"name": "window_r4", "B": 1, "Hq": 2, "Hkv": 1, "S": 32, "D": 8, "window": 5},
    {"name": "gqa_window_r4_matmul", "B": 1, "Hq": 4, "Hkv": 2, "S": 40, "D": 8, "window": 7, "kernel": "matmul"},
    {"name": "packed_gqa_r4", "B": 2, "Hq": 4, "Hkv": 2, "S": 48, "D": 8, "document_starts": [5, 6, 19, 30]},
    {"name": "packed_window_r4_matmul", "B": 1, "Hq": 2, "Hkv": 2, "S": 40, "D": 8, "window": 6,
     "document_starts": [9, 23], "kernel": "matmul"},
    {"name": "mha_r4_float32", "B": 1, "Hq": 4, "Hkv": 4, "S": 64, "D": 16, "dtype": "float32", "tolerance": 2e-6},
]
CASES_BY_NAME = {c["name"]: c for c in RING_CASES}


def _run(stage, kv_heads, sp_size, ring_size, batch_size=1, num_rows=STEPS, **options) -> FitSpec:
    return FitSpec(stage=stage, kv_heads=kv_heads, sp_size=sp_size, batch_size=batch_size, steps=STEPS,
                   seq_len=SEQ_LEN, num_rows=num_rows, lr=LR, strategy={"ring_size": ring_size}, **options)


RUNS = {
    "2x2-zero2-mha": _run(2, 4, sp_size=4, ring_size=2),
    "2x2-zero3-mqa": _run(3, 1, sp_size=4, ring_size=2),
    "1x4-zero2-mqa": _run(2, 1, sp_size=4, ring_size=4),
    "1x4-zero3-mha": _run(3, 4, sp_size=4, ring_size=4),
    "2heads-sp4": _run(2, 2, sp_size=4, ring_size=2, num_heads=2),
    "dp2-ring2": _run(2, 2, sp_size=2, ring_size=2, batch_size=2, num_rows=4 * STEPS),
    # a model built for flex attention (which has no backward on CPU): with ring the ring's own kernels run it
    "2x2-zero2-flex": _run(2, 2, sp_size=4, ring_size=2, attn="flex_attention"),
}


@pytest.fixture(scope="module")
def ring_alone():
    return launch(4, "ring:ring_alone", {"cases": RING_CASES})


PADDED = VarLenDataset([20, 32, 9, 27, 30, 14, 31, 17])
REALDATA = {"padded_2x2": {"dataset": PADDED, "batch_size": 2, "collate_fn": pad_right_collate, "sp_size": 4,
                           "strategy": {"ring_size": 2}, "after": ("validate", "predict"),
                           "trainer": {"limit_val_batches": 1.0}}}
LAYERS = (2, 3)


CKPT_BASE = dict(num_rows=6, seq_len=16, batch_size=1, sp_size=4, max_epochs=2)
CKPT_RUNS = {
    "ring_full": {**CKPT_BASE, "stage": 2, "ckpt_every": 4, "ckpt_dir": "ring", "strategy": {"ring_size": 2}},
    "ulysses_from_ring": {**CKPT_BASE, "stage": 2, "resume": "ring/step=4.ckpt"},  # ring 2x2 -> Ulysses 4
    "ring4_from_ring": {**CKPT_BASE, "stage": 2, "resume": "ring/step=8.ckpt", "strategy": {"ring_size": 4}},
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of 4 processes: the parity runs, collective counts at 2x2, right-padded training + evaluation,
    checkpoints resumed with another ring x Ulysses split."""
    root = tmp_path_factory.mktemp("ring-checkpoints")
    return launch(4, "combined:run", {
        "fits": ["checkpoints:fits", {"root": str(root), "runs": CKPT_RUNS}],
        "parity": ["parity:run", {"runs": list(RUNS.values())}],
        "collectives": ["collectives:run", {"layers": list(LAYERS), "kv_heads": 2, "stage": 2, "sp_size": 4,
                                        "ring_size": 2}],
        "realdata": ["realdata:run", {"cases": REALDATA}],
        "layouts": ["ring:layout_groups", {"layouts": [(4, 2), (4, 4), (2, 1), (2, 2)]}],
    })


@pytest.fixture(scope="module")
def trained(launched):
    return [rank["parity"] for rank in launched]


@pytest.mark.parametrize("name", [c["name"] for c in RING_CASES])
def test_ring_attention_alone_is_exact_in_float64(ring_alone, name):
    for rank in ring_alone:
        r = rank[name]
        print(f"[measured] {name}: out {r['out']:.1e}, dq {r['dq']:.1e}, dk {r['dk']:.1e}, dv {r['dv']:.1e}")
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) <= CASES_BY_NAME[name].get("tolerance", 1e-10)


def test_fused_block_kernels_are_checked_against_the_matmul_kernel(monkeypatch):
    """A fused op is used only where it agrees with the matmul kernel (output, log-sum-exp, gradients; causal, full
    and masked blocks with queries that see nothing): the CPU op agrees; a kernel that is wrong or raises is refused
    with a warning and ring attention falls back to the matmul kernel. (The same check guards the CUDA op.)"""
    from lightning_ulysses.parallel import ring

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert ring._kernel_error("cpu_flash", torch.device("cpu"), dtype) <= ring._KERNEL_TOLERANCE[dtype], dtype
        assert ring.block_kernel(torch.zeros(1, dtype=dtype)) == "cpu_flash"
    forward, backward = ring._KERNELS["cpu_flash"]
    broken = {
        "scaled": (lambda *a: (forward(*a)[0] * 1.001, forward(*a)[1]), backward),  # output off by 0.1%
        "no_empty_rows": (lambda q, k, v, causal, mask, scale: forward(q, k, v, causal, None, scale), backward),
        "grads": (forward, lambda *a: tuple(g * 1.001 for g in backward(*a))),
        "raises": (lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel image")), backward),
    }
    cpu = torch.device("cpu")
    for name, pair in broken.items():
        monkeypatch.setitem(ring._KERNELS, name, pair)
        assert not ring.kernel_agrees(name, cpu, torch.float32), name
        monkeypatch.setitem(ring._KERNELS, name, ring._KERNELS["cpu_flash"])
        assert not ring.kernel_agrees(name, cpu, torch.float32)  # decided once, at first use
        with pytest.warns(UserWarning, match=f"'{name}' disagreed .* runs the exact matmul kernel"):
            assert ring.first_agreeing([name], cpu, torch.float32) == "matmul"
    assert ring.kernel_agrees("cpu_flash", cpu, torch.float32)
    # the next candidate that agrees runs (on CUDA: the op on float32 copies where it disagrees in bf16)
    with pytest.warns(UserWarning, match="'scaled' disagreed .* it runs 'cpu_flash' instead"):
        assert ring.first_agreeing(["scaled", "cpu_flash"], cpu, torch.float32) == "cpu_flash"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_block_kernel_calls_fit_torchs_ops(dtype):
    """The CUDA block kernel's calls of torch's memory-efficient attention op and its backward op (argument order,
    the padded log-sum-exp layout, the aligned bias, philox arguments) run through torch's own shape checks on the
    meta device, for causal, full and masked blocks of a length that is not a tile multiple. Its numbers are checked
    on a GPU (tests/test_cuda.py) and, at first use, against the matmul kernel (ring.kernel_agrees)."""
    from lightning_ulysses.parallel import ring

    B, h, c, D = 2, 4, 40, 16
    q, k, v, dout = (torch.empty(B, h, c, D, device="meta", dtype=dtype) for _ in range(4))
    pos = torch.arange(c)
    late = ring.causal_window_mask(pos, pos + c // 2, 7)
    for causal, mask in ((True, None), (False, None), (False, late), (False, late[None, None].expand(B, 1, c, c))):
        mask = None if mask is None else mask.to("meta")
        out, lse = ring._cuda_efficient_forward(q, k, v, causal, mask, 0.125)
        assert out.shape == (B, h, c, D) and out.dtype == dtype and lse.shape == (B, h, c)
        grads = ring._cuda_efficient_backward(dout, q, k, v, out, lse.float(), causal, mask, 0.125)
        assert [tuple(g.shape) for g in grads] == [(B, h, c, D)] * 3


@pytest.mark.parametrize("name", list(RUNS))
def test_ring_training_matches_single_device(trained, name):
    index = list(RUNS).index(name)
    run = RUNS[name]
    global_batch = run.batch_size * (4 // run.sp_size)
    check_against_reference(run, [rank["runs"][index] for rank in trained], global_batch=global_batch)


def test_ring_shards_are_cut_for_every_rank_and_no_rank_attends_the_whole_sequence(trained):
    run = trained[0]["runs"][list(RUNS).index("2x2-zero2-mha")]
    assert set(run["input_shapes"]) == {(1, SEQ_LEN // 4)}
    assert run["attention_query_shapes"] == []  # the ring kernel attends block by block, never full-length SDPA


@pytest.mark.parametrize("layers", LAYERS)
def test_collectives_per_attention_layer_at_2x2(launched, layers):
    """Per layer at 2x2: the two Ulysses all-to-alls (q/k/v packed, output) in forward and in backward, and the ring's
    point-to-point passes: K/V blocks R - 1 = 1 in forward; in backward K/V blocks R - 1 = 1 and their key/value
    gradients R = 2 (back to their owners), each started before the block's compute so that it overlaps; one
    all-reduce per step for the loss."""
    counts = [rank["collectives"][layers] for rank in launched]
    assert all(c == counts[0] for c in counts)
    assert counts[0]["forward"] == {"alltoall_base_": 2 * layers, "allreduce_": 1, "ring_passes": 1 * layers}
    assert counts[0]["backward"]["alltoall_base_"] == 2 * layers
    assert counts[0]["backward"]["ring_passes"] == 3 * layers


def test_one_mesh_holds_every_group(launched):
    """One ``("dp", "ring", "ulysses")`` mesh per layout, ``sp`` its flattened ``ring × ulysses``: SP groups of
    consecutive ranks, Ulysses groups consecutive inside them, ring groups strided by the Ulysses size, DP across;
    ``ring_size = 1`` is the same mesh with ring groups of one rank."""
    expected = {  # (sp, ring): rank -> (sp group, ulysses group, ring group, dp group)
        (4, 2): lambda r: ([0, 1, 2, 3], [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2], [r]),
        (4, 4): lambda r: ([0, 1, 2, 3], [r], [0, 1, 2, 3], [r]),
        (2, 1): lambda r: ([r - r % 2, r - r % 2 + 1], [r - r % 2, r - r % 2 + 1], [r], [r % 2, r % 2 + 2]),
        (2, 2): lambda r: ([r - r % 2, r - r % 2 + 1], [r], [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]),
    }
    for rank, result in enumerate(launched):
        for key, groups in expected.items():
            got = result["layouts"][key]
            assert got["dims"] == ("dp", "ring", "ulysses") and got["sp_dims"] == ("sp",)
            assert (got["sp"], got["ulysses"], got["ring"], got["dp"]) == groups(rank), (key, rank, got)
            sp = key[0]
            assert got["ranks"] == (rank // sp, rank % sp, 4 // sp)


def test_right_padding_validation_and_predictions_with_ring(launched):
    from tests.test_realdata import ordered_batches

    config = tiny_llama_config(num_kv_heads=2)
    reference = train_on_batches(config, ordered_batches(PADDED, 2))
    result = launched[0]["realdata"]["padded_2x2"]
    assert rel_diff(result["losses"], reference["losses"]) <= REL_TOL
    from tests.support.models import build_llama

    initial = dict(build_llama(config).named_parameters())
    assert update_rel_diff(result["weights"], reference["weights"], initial) <= REL_TOL
    model = reference["model"]
    batches = [pad_right_collate([PADDED[i], PADDED[i + 1]]) for i in range(0, len(PADDED), 2)]
    with torch.no_grad():
        outputs = [model(**b) for b in batches]
    val_loss = sum(o.loss.item() for o in outputs) / len(outputs)
    for rank in launched:
        got = rank["realdata"]["padded_2x2"]
        assert got["validate"]["val_loss"] == pytest.approx(val_loss, rel=REL_TOL)
        for prediction, output, batch in zip(got["predict"], outputs, batches):
            real = batch["attention_mask"].bool()  # compare the real tokens' logits (pads attend nothing useful)
            assert rel_diff(prediction[real], output.logits[real]) <= REL_TOL


@pytest.mark.parametrize("name, first_step", [("ulysses_from_ring", 5), ("ring4_from_ring", 9)])
def test_resume_with_another_ring_ulysses_split(launched, name, first_step):
    from tests.test_checkpoints import assert_continues, global_steps

    fits = [rank["fits"] for rank in launched]
    assert_continues(global_steps(fits, name), global_steps(fits, "ring_full"), first_step)


# Packed documents (position_ids restarting at 0) with ring: document boundaries on global positions in the zigzag
# layout, through the harness of tests/test_steps.py (its one-device reference keeps the documents apart by a mask).
PACKED_RING = [
    {"name": f"packed-ring{r}x{u}-zero{stage}", "step": "model_loss", "reference": "mask_and_labels",
     "data": "packed", "stage": stage, "sp_size": r * u, "strategy": {"ring_size": r}}
    for r, u in ((2, 1), (2, 2)) for stage in (2, 3)
]


@pytest.fixture(scope="module")
def packed_ring():
    two = launch(2, "steps:run", {"cases": [c for c in PACKED_RING if c["sp_size"] == 2]})
    four = launch(4, "steps:run", {"cases": [c for c in PACKED_RING if c["sp_size"] == 4]})
    return {name: [r[name] for r in ranks] for ranks in (two, four) for name in ranks[0]}


@pytest.mark.parametrize("index", range(len(PACKED_RING)), ids=[c["name"] for c in PACKED_RING])
def test_packed_documents_with_ring_train_like_one_device(packed_ring, index):
    from tests.test_steps import check_exact

    case = PACKED_RING[index]
    check_exact(case, packed_ring[case["name"]])

"""The model-form check: before the first step, prove on a short probe that the model's output does not depend on
which shard a rank holds.

The strategy makes the model forms it knows exact (Hugging Face attention, RoPE on global positions, own models that
take ``position_ids``/``input_pos``). A model it does not know may compute something from its shard as if the shard
were the whole sequence: positions ``torch.arange(T)`` or a RoPE cache sliced ``cos[:T]`` from the local length, a
frequency choice from the local largest position, a bidirectional window around each token, a per-sequence
statistic. Nothing fails; the training is silently another one.

So before the first step (training, validation, test or predict) of every Trainer stage, every rank runs a probe:

* a short row of ``L = U·k`` tokens (``U``: the SP layout's unit, ``sp`` or ``2·sp`` with ring; ``k``: 4 tokens, or
  enough for the probe to outgrow the longest attention window the model's config names, at most 512 tokens in
  all), taken from the real batch, with
  positions placed where the real batch's are: block ``u`` of the probe holds the last ``k`` positions of block ``u``
  of the real (padded) row, so each rank's probe shard ends at the position its real shard ends at and the probe's
  largest position is the real row's (length-dependent RoPE, learned positions and position caches see what they
  would see in the step);
* the model once on the whole probe (plain, unsharded, as one device runs it) and once sharded exactly as a step
  runs (the rank's probe shard, the exchange around attention and mixers, call completion);
* this rank's positions of the whole run's output compared with the sharded output (fp32: relative ``1e-4``; bf16
  and fp16: ``5e-2``), and the verdict agreed over all ranks, so that every rank stops, before any weight changes,
  with a message naming the first module whose output differs (found by running both passes again with every
  submodule's output recorded, only when a difference was found).

When the real batch has no ``position_ids`` (the strategy fills them in), a second probe runs the same tokens at
positions ``0..L-1``, the whole run without ``position_ids`` as one device runs such a batch
(:func:`contiguous_probe`): a model that numbers its positions itself otherwise is caught there.

Both runs are forward passes without gradients in eval mode (no dropout) with the random state restored. Cost: two
forward passes of ``L`` tokens (``L`` = 8 at sp=2), four with the second probe, once per stage (measured in
``benchmarks/integrity_cost.py``).
``UlyssesDeepSpeedStrategy(check_model_form=False)`` switches it off.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.models import position_numbering
from lightning_ulysses.parallel.geometry import SequenceGeometry
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.patches import put_on_instance, take_from_instance
from lightning_ulysses.training.step_context import StepContext, StepFacts

PROBE_TOKENS_PER_BLOCK = 4
MAX_PROBE_TOKENS = 512
_probe_depth = 0


def probe_running() -> bool:
    """Whether the model-form check's probe is running now: for instrumentation that counts or records a step's
    calls (attention shapes, collectives) and should leave the probe's forward passes out."""
    return _probe_depth > 0


@dataclass
class Probe:
    """A probe row: ``ids``/``positions`` ``[1, L]`` whole (the same on every SP rank), this rank's ``index`` ``[n]``
    into it and the :class:`ShardInfo` of the sharded run."""

    ids: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor
    shard: ShardInfo


# Config keys that are lengths in tokens past which a model computes differently. The probe grows past the longest
# of these (at most MAX_PROBE_TOKENS in all), so that banded and chunked kernels run on it.
_GROWN_KEYS = ("sliding_window", "local_attention", "attention_window", "window_size", "attention_chunk_size")
# Length thresholds the strategy's own code computes on global positions, so that the probe need not reach them.
HANDLED_LENGTHS = {
    "sliding_window": "sliding-window attention on global positions",
    "attention_chunk_size": "chunked attention with chunk boundaries of the whole row (models/hf_attention.py)",
    "floor_scale": "Llama 4's attention temperature from global positions (models/hf_attention.py)",
}
_LENGTH_WORDS = ("window", "chunk", "floor_scale")
# not thresholds of what a token sees: state-space scan blocks (any blocking gives the same result), feed-forward
# chunks, layer counts, inference-only settings
_NOT_LENGTHS = ("mamba_chunk_size", "chunk_size", "chunk_size_feed_forward")
_NOT_LENGTH_PARTS = ("_layers", "inference")


def _configs(model: nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    return [config] + [getattr(config, key, None) for key in (getattr(config, "sub_configs", {}) or {})]


def longest_window(models: list[nn.Module]) -> int:
    """The longest attention window or chunk any config of ``models`` names (0 if none)."""
    longest = 0
    for model in models:
        for cfg in _configs(model):
            for key in _GROWN_KEYS:
                value = getattr(cfg, key, None)
                if isinstance(value, int) and value > 0:
                    longest = max(longest, value)
    return longest


def unchecked_lengths(models: list[nn.Module], probe_length: int) -> list[str]:
    """``"key=value"`` for every length threshold of the models' configs (a name with "window", "chunk" or
    "floor_scale") that the probe of ``probe_length`` tokens does not reach and that the strategy does not handle on
    global positions itself: what the model does past it is not checked."""
    found = []
    for model in models:
        for cfg in _configs(model):
            for key, value in sorted(vars(cfg).items()) if cfg is not None else ():
                if (isinstance(value, int) and not isinstance(value, bool) and value >= probe_length
                        and any(word in key for word in _LENGTH_WORDS) and key not in HANDLED_LENGTHS
                        and key not in _NOT_LENGTHS and not any(part in key for part in _NOT_LENGTH_PARTS)):
                    found.append(f"{key}={value}")
    return sorted(set(found))


def build_probe(real: ShardInfo, local_ids: torch.Tensor, geometry: SequenceGeometry, sp_rank: int,
                sp_group: dist.ProcessGroup, window: int = 0) -> Probe:
    """The probe for a real batch of padded length ``real.padded_len`` whose shard of ``input_ids`` is ``local_ids``
    ``[B, s]`` (one all-gather over the SP group)."""
    unit = geometry.padded_length(1)  # blocks of the padded row each owned by one SP rank
    block = real.padded_len // unit  # m: tokens per block of the real row
    # k tokens per block: 4, or enough for the probe to be longer than the longest window (so banded window kernels
    # run), at most MAX_PROBE_TOKENS in all
    covering = math.ceil((window + 1) / unit) if window else 0
    k = min(block, max(PROBE_TOKENS_PER_BLOCK, min(covering, MAX_PROBE_TOKENS // unit)))
    length = unit * k  # L
    # [L]: probe block u holds the last k positions of real block u
    blocks = torch.arange(unit).repeat_interleave(k)
    positions = blocks * block + (block - k) + torch.arange(k).repeat(unit)
    index = geometry.shard_index(length, sp_rank)  # [n]: this rank's probe positions in the probe row
    real_index = real.global_index  # [s]: this rank's positions in the real row
    local_slot = torch.searchsorted(real_index.sort().values, positions[index])  # [n] where they sit in the shard
    order = real_index.argsort()
    local_tokens = local_ids[:1, order[local_slot]].contiguous()  # [1, n]
    sp = group_size(sp_group)
    gathered = [torch.empty_like(local_tokens) for _ in range(sp)]
    if sp > 1:
        dist.all_gather(gathered, local_tokens, group=sp_group)  # sp × [1, n], SP-rank order
    else:
        gathered = [local_tokens]
    whole_ids = torch.empty(1, length, dtype=local_ids.dtype, device=local_ids.device)
    whole_ids[:, geometry.full_order(length).to(local_ids.device)] = torch.cat(gathered, dim=1)  # [1, L]
    shard = ShardInfo(length)
    shard.position_ids = positions[index][None].clone()  # [1, n]
    shard.global_index = index
    shard.padded_len = length
    shard.target_valid = torch.zeros(1, len(index), dtype=torch.bool)
    shard.max_position = int(positions.max())
    from lightning_ulysses.data.halo import next_token_sources

    shard.halo = next_token_sources(length, geometry, sp_rank)
    return Probe(whole_ids, positions[None].to(local_ids.device), index.to(local_ids.device), shard)


def first_tensor(output: Any) -> Optional[torch.Tensor]:
    """The main tensor of a model's output: ``logits`` / ``last_hidden_state`` of a ``ModelOutput``, else the first
    tensor of a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None) if not isinstance(output, dict) else output.get(key)
        if isinstance(value, torch.Tensor):
            return value
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def tolerance(dtype: torch.dtype) -> float:
    return 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def model_tolerance(model: nn.Module, output: torch.Tensor) -> float:
    """The check's bound for ``model``: a 16-bit one if the model computes in 16 bits (any 16-bit floating parameter)
    even where its output is upcast (Mamba's and many heads' ``logits.float()``: a bf16 run's rounding there is
    bf16's, and measured against float32's bound it stopped exact bf16 runs falsely), else the output's."""
    low = next((p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)), None)
    return tolerance(low or output.dtype)


def relative_difference(whole: torch.Tensor, shard: torch.Tensor) -> float:
    """The largest difference relative to the whole run's largest value; a NaN of one run where the other has a
    number counts as infinite (``max`` would propagate it and ``NaN > tolerance`` is false)."""
    whole, shard = whole.float(), shard.float()
    scale = whole.nan_to_num(nan=0.0).abs().max().clamp_min(1e-6)
    difference = (whole - shard).abs().nan_to_num(nan=float("inf"))
    difference = difference.masked_fill(whole.isnan() & shard.isnan(), 0.0)
    return float((difference.max() / scale).item())


def _sequence_dim(whole: torch.Tensor, shard: torch.Tensor, length: int, n: int) -> Optional[int]:
    if whole.ndim != shard.ndim:
        return None
    for dim in range(whole.ndim):
        if whole.shape[dim] == length and shard.shape[dim] == n and all(
                whole.shape[d] == shard.shape[d] for d in range(whole.ndim) if d != dim):
            return dim
    return None


class ModuleOutputs:
    """Forward hooks that record each submodule's main output tensor per call, in call order."""

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(m): name for name, m in root.named_modules()}
        self.records: list[tuple[str, str, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._record) for m in root.modules() if m is not root]

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        tensor = first_tensor(output)
        if tensor is not None and tensor.is_floating_point():
            self.records.append((self.names.get(id(module), "?"), type(module).__name__, tensor.detach()))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def first_differing_module(whole: ModuleOutputs, sharded: ModuleOutputs, index: torch.Tensor,
                           length: int, bound: Optional[float] = None) -> Optional[str]:
    """The first module (in the sharded run's call order) whose output on this rank's positions differs from its
    output in the whole run."""
    calls: dict[str, list[torch.Tensor]] = {}
    for name, _, tensor in whole.records:
        calls.setdefault(name, []).append(tensor)
    seen: dict[str, int] = {}
    for name, cls, tensor in sharded.records:
        count = seen.get(name, 0)
        seen[name] = count + 1
        candidates = calls.get(name, [])
        if count >= len(candidates):
            continue
        reference = candidates[count]
        dim = _sequence_dim(reference, tensor, length, len(index))
        if dim is None:
            continue
        expected = reference.index_select(dim, index.to(reference.device))
        if relative_difference(expected, tensor) > max(bound or 0.0, tolerance(tensor.dtype)):
            return f"`{name}` ({cls})"
    return None


_PLAIN_VALUES = (int, float, bool, str, type(None), torch.Tensor)


class ModuleStateSnapshot:
    """The state a forward pass may leave behind in modules, to put back afterwards: buffer values (LongRoPE copies
    new frequencies into ``inv_freq``) and public plain attributes (dynamic NTK's ``max_seq_len_cached``, cached
    tensors such as ``long_inv_freq``; attributes added by the pass are removed). Dynamic NTK keeps the largest
    length it has seen, so without this the probe would change what the first real step computes."""

    def __init__(self, roots: list[nn.Module]) -> None:
        self.saved = []
        for root in roots:
            for module in root.modules():
                buffers = {k: v.detach().clone() for k, v in module._buffers.items() if v is not None}
                attributes = {k: v for k, v in vars(module).items() if self._tracked(k, v)}
                self.saved.append((module, dict(module._buffers), buffers, attributes))

    @staticmethod
    def _tracked(name: str, value: Any) -> bool:
        return not name.startswith(("_", "ds_")) and isinstance(value, _PLAIN_VALUES)

    def restore(self) -> None:
        for module, buffer_objects, buffer_values, attributes in self.saved:
            module._buffers.clear()
            module._buffers.update(buffer_objects)
            for name, value in buffer_values.items():
                buffer_objects[name].data.copy_(value)  # in place: the same tensor objects, the old values
            for name in [k for k, v in vars(module).items() if self._tracked(k, v) and k not in attributes]:
                take_from_instance(module, name)
            for name, value in attributes.items():
                put_on_instance(module, name, value)


@contextlib.contextmanager
def quiet_and_repeatable(modules: list[nn.Module], device: torch.device,
                         silence_users_hooks: bool = True) -> Iterator[ModuleStateSnapshot]:
    """Eval mode (no dropout), no gradients, the users' hooks silent (the probe is not one of their forwards); the
    random state and the modules' state (buffers, plain attributes) restored afterwards, so the first real step
    computes what it would have computed without the probe. Yields the snapshot, so that each run can start from it
    (``snapshot.restore()``)."""
    modes = [(m, m.training) for root in modules for m in root.modules()]
    snapshot = ModuleStateSnapshot(modules)
    devices = [device.index or 0] if device.type == "cuda" else []
    silenced = _compat.user_hooks_silenced(modules) if silence_users_hooks else contextlib.nullcontext()
    with torch.random.fork_rng(devices=devices), torch.no_grad(), silenced:
        for root in modules:
            root.eval()
        try:
            yield snapshot
        finally:
            for module, training in modes:
                module.training = training
            snapshot.restore()


class FormCheckFailed(RuntimeError):
    pass


def check_model_form(rounds: list[tuple[list[tuple[nn.Module, Callable[..., Any], Callable[..., Any]]], Probe]],
                     context: StepContext, device: torch.device, plain: Callable[[], contextlib.AbstractContextManager]
                     ) -> None:
    """For each ``(targets, probe)`` of ``rounds``, run every ``(model, whole_call, sharded_call)`` of ``targets`` on
    the probe, whole (inside ``plain()``) and sharded (with ``probe.shard`` as the step's shard facts); raise
    :class:`FormCheckFailed` on every rank if any rank's outputs differ. ``whole_call(model, ids, positions)`` /
    ``sharded_call(model, ids)`` return the output."""
    global _probe_depth
    _probe_depth += 1
    try:
        silence = True  # the users' own hooks do not see the probe, unless the model cannot run without them
        try:
            findings = [f for targets, probe in rounds
                        for f in _run_probe(targets, probe, context, device, plain, False, silence)]
        except _NeedsUsersHooks:
            silence = False
            findings = [f for targets, probe in rounds
                        for f in _run_probe(targets, probe, context, device, plain, False, silence)]
        if _found_on_any_rank(bool(findings), device):  # run again, recording every module, to name the first
            findings = [f for targets, probe in rounds
                        for f in _run_probe(targets, probe, context, device, plain, True, silence)]
            _agree_and_raise(findings, rounds[0][1].ids.shape[1])
    finally:
        _probe_depth -= 1


def contiguous_probe(probe: Probe) -> Probe:
    """The probe's tokens at positions ``0..L-1``, their positions filled in by the strategy as for a batch without
    ``position_ids``: run whole *without* positions (:func:`whole_hf_call_numbering_itself`), as one device runs such
    a batch, it shows a model that numbers its positions itself otherwise than ``0..S-1`` (RoBERTa-style
    embeddings from ``padding_idx + 1``, a decoder that ignores ``position_ids``)."""
    length = probe.ids.shape[1]
    positions = torch.arange(length, device=probe.positions.device)[None]  # [1, L]
    shard = ShardInfo(length)
    for name in ShardInfo.__slots__:
        setattr(shard, name, getattr(probe.shard, name))
    shard.position_ids = positions[:, probe.index.to(positions.device)].cpu().clone()  # [1, n]
    shard.max_position = length - 1
    shard.positions_filled = True
    return Probe(probe.ids, positions, probe.index, shard)


def _found_on_any_rank(found: bool, device: torch.device) -> bool:
    """One all-reduce of one integer over all ranks."""
    flag = torch.tensor([int(found)], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # [1]: a difference on any rank
    return bool(flag.item())


class _NoRecording:
    records: list = []

    def close(self) -> None:
        pass


class _NeedsUsersHooks(Exception):
    """The probe's whole run failed with the users' hooks silent: it runs again with them (a hook the model needs)."""


def _run_probe(targets: list, probe: Probe, context: StepContext, device: torch.device,
               plain: Callable[[], contextlib.AbstractContextManager], locate: bool,
               silence_users_hooks: bool = True) -> list[str]:
    """The probe's two runs per target; with ``locate``, every submodule's output is recorded, to name the first
    module whose output differs; ``silence_users_hooks``: the hooks no model library registered do not run (a hook
    that counts calls or keeps activations sees only the steps' forwards). Where the whole run fails with them
    silent, :class:`_NeedsUsersHooks` asks for a run with them (a hook that the model needs to run at all)."""
    findings: list[str] = []
    n, length = len(probe.index), probe.ids.shape[1]
    local_ids = probe.ids[:, probe.index]  # [1, n]: this rank's probe shard
    probe_facts = StepFacts(shard_info=probe.shard, in_step=True)  # the probe's own: no batch tensors, local tiles
    saved_router_mask = context.router_token_mask
    silenced_some = silence_users_hooks and _compat.has_user_hooks([t[0] for t in targets])
    with quiet_and_repeatable([t[0] for t in targets], device, silence_users_hooks) as snapshot, \
            _compat.zero3_forward_discovery([t[0] for t in targets]):
        for model, whole_call, sharded_call in targets:
            name = type(model).__name__
            whole_outputs = ModuleOutputs(model) if locate else _NoRecording()
            try:
                with plain():
                    whole = first_tensor(whole_call(model, probe.ids, probe.positions))
            except Exception as err:
                if silenced_some:
                    raise _NeedsUsersHooks() from err
                raise RuntimeError(
                    f"UlyssesDeepSpeedStrategy's model-form check could not run {name} on its probe (the batch's"
                    f" token ids, [1, {length}]) as one device would: {type(err).__name__}: {err}. The check calls the"
                    " model that contains the attention as `model(input_ids)` (Hugging Face models with"
                    " `position_ids`/`attention_mask`, own models with `position_ids` or `input_pos` when their"
                    " forward takes them). A model the check cannot run is a model the strategy cannot tell is exact"
                    " under sequence parallelism, so it stops here, before any weight changes; the error above says"
                    " what the model needs. (`check_model_form=False` skips the check: it does not make such a model"
                    " exact, only unchecked.)"
                ) from err
            finally:
                whole_outputs.close()
                snapshot.restore()  # the sharded run starts from the same state (dynamic NTK remembers lengths)
            sharded_outputs = ModuleOutputs(model) if locate else _NoRecording()
            try:
                with context.facts_for(probe_facts):
                    sharded = first_tensor(sharded_call(model, local_ids))
            finally:
                sharded_outputs.close()
                context.record.record_router_token_mask(saved_router_mask)
                snapshot.restore()
            if whole is None or sharded is None:
                continue
            dim = _sequence_dim(whole, sharded, length, n)
            if dim is None:
                findings.append(f"{name} returned {list(sharded.shape)} for this rank's {n} probe tokens and"
                                f" {list(whole.shape)} for all {length}: its output is not per token")
                continue
            difference = relative_difference(whole.index_select(dim, probe.index), sharded)
            bound = model_tolerance(model, sharded)
            if difference > bound:
                module = (first_differing_module(whole_outputs, sharded_outputs, probe.index, length, bound)
                          if locate else None)
                findings.append(f"{name}'s output on this rank's probe positions"
                                f" {probe.shard.position_ids[0].tolist()} differs from the same positions of the whole"
                                f" probe by {difference:.2e} (relative); first module whose output differs: "
                                f"{module or '(none found: the difference arises in the model body itself)'}")
    return findings


def _agree_and_raise(findings: list[str], length: int) -> None:
    """Every rank's findings to every rank; all raise if any rank found a difference."""
    everyone = [None] * (group_size())
    mine = "; ".join(findings) if findings else None
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    failures = [(rank, finding) for rank, finding in enumerate(everyone) if finding]
    if failures:
        lines = "\n".join(f"  rank {rank}: {finding}" for rank, finding in failures)
        raise FormCheckFailed(
            "UlyssesDeepSpeedStrategy stopped before any weight changed: the model's output depends on which shard a"
            " rank holds, so under sequence parallelism it would train (or evaluate) a different model than on one"
            f" device. The check ran the model on a probe of {length} tokens, whole and sharded:\n{lines}\n"
            "The model computes something from its shard as if the shard were the whole sequence: positions from the"
            " local length (`torch.arange(T)`, a position embedding or a RoPE cache sliced by `T`), a frequency or"
            " scale chosen from the local largest position, a window or statistic over the local tokens. Fix: give"
            " that module the global positions (a forward argument named `position_ids` or `input_pos` on the model"
            " that contains your attention cores is filled in by the strategy; in a step, `batch[\"position_ids\"]`"
            " holds them), or compute the quantity from them. Or the module named is an attention the strategy does"
            " not recognise (its forward neither looks its kernel up in transformers' attention interface nor calls"
            " torch's SDPA, and for a Hugging Face model its class name does not end in `Attention`): then each rank"
            " attends within its own shard: an own model declares it with `attention_modules=`; a Hugging Face model"
            " with such a module trains with sp_size=1. See"
            " docs/model-forms.md. (Switching this check off would not make the model exact, only unchecked.)"
        )


def own_model_roots(lightning_module: nn.Module, cores: list[nn.Module], hf_models: list[nn.Module],
                    position_roots: list[nn.Module]) -> list[nn.Module]:
    """The modules the check calls for models that are not Hugging Face ones: the position-taking roots, and for
    declared attention cores outside them and outside the HF models, the outermost module below the LightningModule
    that contains them (its forward is called with the token ids)."""
    covered = {id(m) for root in [*hf_models, *position_roots] for m in root.modules()}
    remaining = [core for core in cores if id(core) not in covered]
    roots = list(position_roots)
    for _, module in lightning_module.named_children():
        if any(any(m is core for m in module.modules()) for core in remaining) and id(module) not in covered:
            roots.append(module)
            covered.update(id(m) for m in module.modules())
    return roots


def _accepts(model: nn.Module, name: str) -> bool:
    from lightning_ulysses.models.calls import accepts_argument

    return accepts_argument(model, name)


def whole_hf_call(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    """A Hugging Face model on the whole probe, as one device runs it (the all-ones mask keeps transformers from
    reading the probe's position jumps as packed documents)."""
    kwargs: dict[str, Any] = {"input_ids": ids}
    if _accepts(model, "position_ids"):  # numbered as the model numbers its own (RoBERTa-style embeddings)
        kwargs["position_ids"] = position_numbering.numbered_as_the_model_does(
            positions, ids, position_numbering.own_numbering_padding_index(model))
    if _accepts(model, "attention_mask"):
        kwargs["attention_mask"] = torch.ones_like(ids)
    return model(**kwargs)


def whole_hf_call_numbering_itself(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    """A Hugging Face model on the whole contiguous probe without ``position_ids``: as one device runs a batch that
    has none (the model numbers its positions itself)."""
    kwargs: dict[str, Any] = {"input_ids": ids}
    if _accepts(model, "attention_mask"):
        kwargs["attention_mask"] = torch.ones_like(ids)
    return model(**kwargs)


def sharded_hf_call(model: nn.Module, ids: torch.Tensor) -> Any:
    return model(input_ids=ids)  # positions filled in by the call completion, as in a step that leaves them out


def whole_own_call(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    from lightning_ulysses.models.calls import position_parameter

    parameter = position_parameter(model)
    return model(ids, **({parameter: positions} if parameter else {}))


def whole_litgpt_call(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    """A LitGPT ``GPT`` on the whole probe with the probe's positions (its RoPE rows put first, as in a step)."""
    from lightning_ulysses.models.litgpt import put_back_rope_rows, rope_rows

    rope_rows(model, positions[0])
    try:
        return model(ids)
    finally:
        put_back_rope_rows(model)


def sharded_own_call(model: nn.Module, ids: torch.Tensor) -> Any:
    return model(ids)

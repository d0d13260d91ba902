"""Every ``*ForCausalLM`` of the installed transformers, built tiny on CPU and fitted with
``UlyssesDeepSpeedStrategy(sp_size=2)`` (3 SGD steps, 2 gloo processes) against the same fit in one plain process, at
five settings: ZeRO 2 fp32 (every model), and for the models exact there ZeRO 3 with every parameter partitioned,
bf16 (``bf16-mixed``, against float64 and one device's bf16), packed rows, and bf16 with packed rows. Writes
``docs/causal-lm-sweep.md`` (the table, one column per setting) and ``benchmarks/results/causal_lm_sweep.json`` (raw).

    python benchmarks/causal_lm_sweep.py                        # all of them (~7 min on a 2-core CPU)
    python benchmarks/causal_lm_sweep.py --only llama,doge      # these rows again (the others kept from the JSON)
    python benchmarks/causal_lm_sweep.py --settings zero3,bf16  # these columns again (the others kept)
    python benchmarks/causal_lm_sweep.py --launch-size 10       # models per 2-process launch

Each model type (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` plus every other exported ``*ForCausalLM``) is built by
``tests/support/sweep.py``: its config class's defaults shrunk generically (hidden 64, 2 layers, 4 heads / 2 KV heads,
head sizes in the family's own ratios, vocabulary 128, windows of half a shard, ...), or the hand-made configuration
of ``tests/support/architectures.py`` where there is one; ``attn_implementation="sdpa"`` where the class supports it,
otherwise its default. Outcomes:

* ``does not build on CPU``: the config, the model or a plain forward / backward in this process fails;
* ``exact``: the SP fit matches the plain one: per-step losses within 1e-5, every parameter's update within 1e-4
  (relative; the largest differences measured are reported); bf16: SP's errors against float64 at most twice one
  device's in bf16;
* ``refused``: the strategy's own code raised before the first step (its message is reported);
* ``WRONG``: the SP fit trained but differs from the plain one (the important finding);
* ``crashed``: any other error during the SP fit (or the processes died / timed out);
* ``n/a``: the setting does not apply without SP either (packed rows transformers' own forward mixes, a dtype the
  model does not train in on one device).

The plain references run in this process; the SP fits run ``--launch-size`` models per launch. A model that kills or
hangs the processes is recorded as ``crashed`` and the launch goes on from the next model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pickle
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tests.support import sweep  # noqa: E402
from tests.support.launcher import launch  # noqa: E402

# What the sweep's WRONG and crashed rows come from, as far as read from the models' code: title -> (model types,
# explanation), listed under the table for the model types that keep that outcome. (Found by the sweep and fixed since:
# RoBERTa-style positions, silently wrong before fcd2a74; ZAYA and BLT, crashing on shapes before 4c7a9bf.)
FINDINGS: dict[str, tuple[list[str], str]] = {
    "PhiMoE stochastic routing": (
        ["phimoe"],
        "In training mode PhiMoE's `sparsemixer` picks experts by Gumbel sampling and draws its Heun mask from "
        "torch's RNG, so the fit depends on the RNG state, as with dropout: one process seeded 2 after building "
        "differs from the reference by as much (update 2.2), and one process seeded 1 reproduces the SP fit "
        "(losses within 1e-7). A difference of random draws, not of sharding (measured by hand, "
        "transformers 5.24)."),
    "Whisper decoder positions": (
        ["whisper"],
        "`WhisperForCausalLM.forward` takes no `position_ids`: its decoder numbers positions 0..s-1 of the local "
        "shard (and its labels are not shifted). The ranks' losses differ and the strategy's loss-agreement check "
        "stops the fit after the first forward, before any weight changes: caught, not silent."),
    "bf16 MoE loss after two updates": (
        ["granitemoe_swa"],
        "bf16 with packed rows only (exact in fp32 at every setting, and in bf16 without packing): the first two "
        "losses are off float64 as one device's (3.2e-5 / 3.5e-5 against 2.7e-5 / 3.0e-5), the update error is "
        "1.01x one device's, and the third loss, after two updates, is off 2.4e-4 against 0.9-1.3e-4 for the "
        "one-device computations (with the row repeated 2 or 4 times in the batch: 1.3e-4 / 0.9e-4, measured by hand). "
        "Under SP each rank's gradient is a partial sum over its shard, rounded to bf16 before DeepSpeed's bf16 "
        "reduction adds the two: one rounding more than one device makes (as data parallelism has), which a "
        "mixture-of-experts router can turn into another expert choice for a token at the next step. SP's doing, "
        "through DeepSpeed's bf16 gradients; within bf16's noise in the weights, above 2x in one step's loss."),
}


def _finding(model_type: str):
    return next((title for title, (types, _) in FINDINGS.items() if model_type in types), None)


MODEL_TIMEOUT = 240  # seconds for one model's SP fit (the slowest tiny ones take ~20 s on a loaded 2-core CPU)


def _references(models: dict[str, str], setting: str = sweep.ZERO2) -> tuple[dict, dict]:
    """The plain single-process fits at ``setting``; rows for the models that do not build (at ZeRO 2) or for which
    the setting does not apply (the others)."""
    references, rows = {}, {}
    for model_type, class_name in models.items():
        start = time.monotonic()
        try:
            references[model_type] = sweep.train_reference(model_type, class_name, setting=setting)
        except sweep.NotApplicable as why:
            rows[model_type] = {"outcome": sweep.NOT_APPLICABLE, "reason": str(why)}
        except Exception as err:  # noqa: BLE001 - recorded as the reason
            outcome = sweep.NOT_BUILDING if setting == sweep.ZERO2 else sweep.NOT_APPLICABLE
            rows[model_type] = {"outcome": outcome, "reason": sweep.first_line(err, 200)}
        print(f"[plain {setting}] {model_type}: "
              f"{'built' if model_type in references else rows[model_type]['reason']}"
              f" ({time.monotonic() - start:.1f} s)", flush=True)
    return references, rows


def _read_progress(folder: Path, model_type: str) -> list:
    out = []
    for rank in range(2):
        path = folder / f"rank{rank}" / f"{model_type}.pkl"
        out.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    return out


def _log_tail(message: str, limit: int = 300) -> str:
    """The last line of the failed launch's report that says what went wrong."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for marker in ("[sweep]", "Error", "error", "Killed", "Segmentation"):
        found = [line for line in lines if marker in line and not line.startswith("---")]
        if found:
            return found[-1][:limit]
    return (lines[-1] if lines else "no output")[:limit]


def _fit_all(models: dict[str, str], launch_size: int, setting: str = sweep.ZERO2) -> dict[str, list]:
    """The per-rank results of the SP fits, ``None`` for a rank that left no result (then ``[crash reason]``)."""
    results: dict[str, list] = {}
    pending = list(models)
    while pending:
        batch = {m: models[m] for m in pending[:launch_size]}
        with tempfile.TemporaryDirectory(prefix="causal-lm-sweep-") as progress:
            start = time.monotonic()
            payload = {"models": batch, "steps": sweep.STEPS, "progress": progress, "model_timeout": MODEL_TIMEOUT,
                       "setting": setting}
            failure = None
            try:
                launch(2, "causal_lm_sweep:run", payload, timeout=MODEL_TIMEOUT * len(batch) + 120)
            except RuntimeError as err:
                failure = str(err)
            done = []
            for model_type in batch:
                ranks = _read_progress(Path(progress), model_type)
                if all(r is not None for r in ranks):
                    results[model_type] = ranks
                    done.append(model_type)
                    continue
                if failure is not None:  # the first model without both results is the one that ended the launch
                    reason = next((r["error"] for r in ranks if r is not None and r.get("error")), None)
                    results[model_type] = [{"error": f"the processes died: {reason or _log_tail(failure)}",
                                            "raised_by_strategy": False, "losses": []}] * 2
                    done.append(model_type)
                break
            print(f"[launch {setting}] {len(done)} of {len(batch)} models in {time.monotonic() - start:.0f} s"
                  + (f"; ended by {done[-1]}" if failure else ""), flush=True)
            if not done:
                raise RuntimeError(f"a launch made no progress:\n{failure}")
            pending = [m for m in pending if m not in done]
    return results


def _versions() -> dict:
    import deepspeed
    import lightning
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "lightning": lightning.__version__, "lightning_ulysses": _commit()}


def _commit() -> str:
    """The repository's commit, ``+ uncommitted changes`` when the library's files differ from it (other edits in
    progress change the outcomes: run the sweep on a clean tree). ``SWEEP_COMMIT`` overrides (a tree without git)."""
    import subprocess

    if os.environ.get("SWEEP_COMMIT"):
        return os.environ["SWEEP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_ulysses"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else "nan" if math.isnan(x) else f"{x:.1e}"


COLUMN_TITLES = {sweep.ZERO2: "ZeRO 2", sweep.ZERO3: "ZeRO 3 partitioned", sweep.BF16: "bf16",
                 sweep.PACKED: "packed", sweep.BF16_PACKED: "bf16 packed"}


def _cell(row: dict, setting: str) -> str:
    """One setting's outcome with its measured differences (bf16: SP's error over one device's, loss / update)."""
    outcome = row["outcome"]
    shown = f"**{outcome}**" if outcome in (sweep.WRONG, sweep.CRASHED) else outcome
    if outcome not in (sweep.EXACT, sweep.WRONG):
        return shown
    if setting in (sweep.BF16, sweep.BF16_PACKED):
        return f"{shown} {row['loss_ratio']:.1f}x / {row['update_ratio']:.1f}x"
    return f"{shown} {_fmt(row['loss_diff'])} / {_fmt(row['update_diff'])}"


def _notes(model_type: str, row: dict, setting: str) -> list[str]:
    title = "" if setting == sweep.ZERO2 else f"{COLUMN_TITLES[setting]}: "
    notes = []
    bf16 = setting in (sweep.BF16, sweep.BF16_PACKED)
    if row["outcome"] in (sweep.EXACT, sweep.WRONG) and not bf16:
        if row["outcome"] == sweep.WRONG or row["update_diff"] > 1e-5:
            notes.append(f"{title}worst: `{row['worst_param']}`")
        if setting == sweep.ZERO2 and row.get("update_tol", sweep.UPDATE_TOL) != sweep.UPDATE_TOL:
            notes.append(f"update bound {row['update_tol']:.0e} (the model's own fp32 rounding, "
                         "tests/support/architectures.py)")
    if row["outcome"] == sweep.WRONG and bf16:
        notes.append(f"{title}loss error {row['loss_error']:.1e} (one device {row['one_loss_error']:.1e}), update "
                     f"error {row['update_error']:.1e} (one device {row['one_update_error']:.1e}), parameters "
                     f"{row.get('parameter_dtypes')}")
    if row["outcome"] in (sweep.EXACT, sweep.WRONG) and not row.get("ranks_agree", True):
        notes.append(f"{title}the ranks' losses differ")
    if row["outcome"] not in (sweep.EXACT, sweep.WRONG, sweep.NOT_RUN) and not (
            setting == sweep.BF16_PACKED and row["outcome"] == sweep.NOT_APPLICABLE):  # said under packed or bf16
        reason = row["reason"].replace("\n", " ")
        notes.append(title + (reason if len(reason) <= 160 else reason[:157] + "..."))
        if row["outcome"] == sweep.CRASHED and row.get("raised_in"):
            notes.append(f"(at `{row['raised_in']}`)")
    if row["outcome"] in (sweep.WRONG, sweep.CRASHED) and _finding(model_type):
        notes.append(f"why: see *{_finding(model_type)}* below")
    return notes


def setting_rows(row: dict) -> dict[str, dict]:
    """A model's outcome per setting: the base row (ZeRO 2) and the others recorded under ``settings``; a setting
    not run (the model is not exact at ZeRO 2) is ``NOT_RUN``."""
    other = row.get("settings", {})
    return {s: row if s == sweep.ZERO2 else other.get(s, {"outcome": sweep.NOT_RUN}) for s in sweep.SETTINGS}


def write_table(data: dict) -> None:
    models = data["models"]
    counts = {o: sum(r["outcome"] == o for r in models.values())
              for o in (sweep.EXACT, sweep.REFUSED, sweep.WRONG, sweep.CRASHED, sweep.NOT_BUILDING)}
    built = len(models) - counts[sweep.NOT_BUILDING]
    per_setting = {}
    for setting in sweep.SETTINGS[1:]:
        outcomes = [setting_rows(r)[setting]["outcome"] for r in models.values() if r["outcome"] == sweep.EXACT]
        per_setting[setting] = {o: outcomes.count(o) for o in dict.fromkeys(outcomes)}
    v = data["versions"]
    lines = [
        "# Every `*ForCausalLM` of transformers under `UlyssesDeepSpeedStrategy(sp_size=2)`",
        "",
        f"lightning-ulysses at {v.get('lightning_ulysses', 'unknown')}; transformers {v['transformers']}, torch "
        f"{v['torch']}, DeepSpeed {v['deepspeed']}, Lightning {v['lightning']}; CPU, 2 gloo processes; "
        f"{data['date']}. Regenerate with `{sweep.COMMAND}` "
        "(`--only a,b` reruns some rows, `--settings zero3,bf16` some columns); raw results: "
        "`benchmarks/results/causal_lm_sweep.json`.",
        "",
        "Every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, plus the other `*ForCausalLM` classes transformers "
        "exports, built tiny (`tests/support/sweep.py`: the config class's defaults shrunk to hidden 64, 2 layers "
        "(one of each layer kind), 4 heads / 2 KV heads, head size 16 (a family with head sizes of several values "
        f"keeps their ratios, the largest {sweep.LARGEST_HEAD}: value heads against query/key heads, linear-attention "
        "heads against attention heads), vocabulary 128, windows of 8 tokens (half a shard), 4 experts; the "
        "hand-made configuration of `tests/support/architectures.py` where its model type has one, marked *) with "
        "`attn_implementation=\"sdpa\"` where supported, else the class's default, fp32. Each is fitted for 3 SGD "
        "steps on 32-token rows with sp_size=2 and compared with the same fit in one plain process, at four "
        "settings (the columns):",
        "",
        "* **ZeRO 2**, fp32: per-step losses within 1e-5, each parameter's update within 1e-4, relative (the largest "
        "measured differences are shown, loss / update);",
        "* **ZeRO 3 partitioned**: stage 3 with `stage3_param_persistence_threshold=0` (every parameter partitioned, "
        "gathered by DeepSpeed's hooks around each module), fp32, the same bounds;",
        "* **bf16**: Lightning's `precision=\"bf16-mixed\"` at ZeRO 2 (bf16 weights and activations, float32 master "
        "weights); the references are the same training on one device in float64 and in bf16 (float32 master "
        "weights; the parameters cast and the buffers kept in float32, as DeepSpeed casts a module), the bf16 one "
        "computed four equally valid ways (SDPA's default and math CPU kernels, eager attention, the row repeated 3 "
        "times in the batch), bf16's own error being the largest of the four: a single run's loss error is one "
        "sample of rounding noise and varies by several times between them; exact when SP's per-step loss error "
        f"and update error against float64 are at most {sweep.BF16_RATIO:g}x bf16's own (shown: the two ratios) and "
        "the weights trained in bf16;",
        "* **packed**: each row packs 2-3 documents (`position_ids` restarting at each, labels -100 at each "
        "document's first token, one document across the shard boundary), `sdpa_per_document=True`; the reference "
        "is the same packed rows in one plain process, run only where transformers' own forward keeps packed "
        "documents apart (a packed row's logits equal its documents' alone), else *n/a* (its reason is noted "
        "once, under *packed*);",
        "* **bf16 packed**: the two at once (bf16's criterion, on the packed rows).",
        "",
        "The other settings run for the model types exact at ZeRO 2 (*-* where not).",
        "",
        f"**{len(models)} model types: {built} build on CPU, {counts[sweep.EXACT]} exact at ZeRO 2, "
        f"{counts[sweep.REFUSED]} refused before compute, {counts[sweep.WRONG]} WRONG (trained but differ), "
        f"{counts[sweep.CRASHED]} crashed, {counts[sweep.NOT_BUILDING]} do not build on CPU.** Of the "
        f"{counts[sweep.EXACT]} exact at ZeRO 2: "
        + "; ".join(f"{COLUMN_TITLES[s]}: " + ", ".join(f"{n} {o}" for o, n in c.items())
                    for s, c in per_setting.items()) + ".",
        "",
        "Outcomes: *exact* — the SP fit matches; *refused* — the strategy stopped it with an error before the "
        "first step (its message); *WRONG* — it trained but differs from one process; *crashed* — another error "
        "during the SP fit; *does not build on CPU* — the tiny config, the model or its plain forward fails in one "
        "process (the error), so there is nothing to compare; *n/a* — the setting does not apply without SP either "
        "(packed rows its own forward mixes or cannot take, a dtype it does not run in on CPU). The hand-made "
        "configurations are also run by `tests/test_architectures.py`; `tests/test_causal_lm_sweep.py` checks that "
        "this table covers every class and reruns a sample at every setting.",
        "",
        "| model_type | class | " + " | ".join(COLUMN_TITLES[s] for s in sweep.SETTINGS) + " | notes |",
        "|---|---|" + "---|" * len(sweep.SETTINGS) + "---|",
    ]
    for model_type, row in sorted(models.items()):
        star = " *" if row.get("hand_made") else ""
        by_setting = setting_rows(row)
        cells = [_cell(by_setting[s], s) for s in sweep.SETTINGS]
        notes = "; ".join(n for s in sweep.SETTINGS for n in _notes(model_type, by_setting[s], s)).replace("|", "\\|")
        lines.append(f"| `{model_type}`{star} | `{row['class']}` | " + " | ".join(cells) + f" | {notes} |")
    bad = {m for m, r in models.items() for s in setting_rows(r).values() if s["outcome"] in (sweep.WRONG,
                                                                                             sweep.CRASHED)}
    listed = {title: [m for m in types if m in bad] for title, (types, _) in FINDINGS.items()}
    if any(listed.values()):
        lines += ["", "## What the WRONG and crashed cells come from", ""]
        for title, (_, text) in FINDINGS.items():
            if listed[title]:
                lines.append(f"* **{title}** ({', '.join(f'`{m}`' for m in listed[title])}): {text}")
    unexplained = sorted(m for m in bad if not _finding(m))
    if unexplained:
        lines.append(f"* Not yet looked into: {', '.join(f'`{m}`' for m in unexplained)}.")
    sweep.TABLE.write_text("\n".join(lines) + "\n")


def _sweep_setting(setting: str, models: dict[str, str], launch_size: int) -> dict[str, dict]:
    """Rows of one setting: the references here, the SP fits launched, each classified."""
    references, rows = _references(models, setting)
    fits = _fit_all({m: models[m] for m in models if m in references}, launch_size, setting)
    for model_type, ranks in fits.items():
        rows[model_type] = sweep.classify(model_type, references[model_type], ranks, setting)
        rows[model_type]["sp_fit_seconds"] = max(r.get("seconds", 0) for r in ranks)
    for row in rows.values():
        if row["outcome"] in (sweep.REFUSED, sweep.CRASHED):
            row["reason"] = row["reason"][:300]
        for key in ("losses", "plain_losses"):
            if key in row:
                row[key] = [float(x) for x in row[key]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (the other rows are kept)")
    parser.add_argument("--settings", default=",".join(sweep.SETTINGS),
                        help=f"comma-separated columns to run, of {','.join(sweep.SETTINGS)} (the others are kept)")
    parser.add_argument("--launch-size", type=int, default=20, help="models per 2-process launch")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    classes = sweep.causal_lm_classes()
    only = [m for m in args.only.split(",") if m]
    unknown = [m for m in only if m not in classes]
    if unknown:
        raise SystemExit(f"not a *ForCausalLM model type of this transformers: {unknown}")
    settings = [s for s in args.settings.split(",") if s]
    if set(settings) - set(sweep.SETTINGS):
        raise SystemExit(f"settings are {sweep.SETTINGS}, not {sorted(set(settings) - set(sweep.SETTINGS))}")
    models = {m: classes[m] for m in (only or classes)}
    start = time.monotonic()
    partial = bool(only) or settings != list(sweep.SETTINGS)
    data = json.loads(sweep.RESULTS.read_text()) if partial and sweep.RESULTS.exists() else {"models": {}}
    if sweep.ZERO2 in settings:
        rows = _sweep_setting(sweep.ZERO2, models, args.launch_size)
        for model_type, row in rows.items():
            row["class"] = models[model_type]
            row["hand_made"] = list(sweep.hand_made_parts(model_type))
            row["attn_implementation"] = sweep.attn_implementation(models[model_type])
            row["settings"] = {}
            data["models"][model_type] = row
    base = data["models"]
    missing = [m for m in models if m not in base]
    if missing:
        raise SystemExit(f"no ZeRO 2 row recorded for {missing}: run with --settings zero2 first")
    exact = {m: c for m, c in models.items() if base[m]["outcome"] == sweep.EXACT}
    for model_type in models:
        if model_type not in exact:
            base[model_type]["settings"] = {}
    for setting in settings:
        if setting == sweep.ZERO2:
            continue
        for model_type, row in _sweep_setting(setting, exact, args.launch_size).items():
            base[model_type].setdefault("settings", {})[setting] = row
    data["models"] = dict(sorted(base.items()))
    data.update(versions=_versions(), date=datetime.date.today().isoformat(), command=sweep.COMMAND)
    sweep.RESULTS.parent.mkdir(parents=True, exist_ok=True)
    sweep.RESULTS.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    write_table(data)
    counts: dict[str, dict[str, int]] = {}
    for model_type in models:
        for setting, row in setting_rows(base[model_type]).items():
            if setting in settings:
                counts.setdefault(setting, {}).setdefault(row["outcome"], 0)
                counts[setting][row["outcome"]] += 1
                if row["outcome"] in (sweep.WRONG, sweep.CRASHED):
                    print(f"  {setting} {row['outcome']}: {model_type}: {row.get('reason') or row}")
    print(f"{len(models)} model types in {time.monotonic() - start:.0f} s: {counts}")
    print(f"wrote {sweep.TABLE.relative_to(REPO_ROOT)} and {sweep.RESULTS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()

"""LightningCLI (``examples/cli/train.py``): the strategy from flags and from YAML, every strategy argument visible
with its type, and real training with SP=2 started by Lightning's own launcher (``Trainer(devices=2)`` re-runs the
script for rank 1).

Parsing runs in this process (the CLI builds the Trainer with ``run=False``); training runs the example script as a
user would, with ``tests.scenarios.launchers.LaunchReport`` added through ``--trainer.callbacks+=`` to report per rank.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (pip install -e '.[cli]')")

from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402

from lightning_ulysses import UlyssesDeepSpeedStrategy  # noqa: E402
from tests.support.launcher import REPO_ROOT  # noqa: E402
from tests.test_launchers import clean_env  # noqa: E402

CLI_SCRIPT = REPO_ROOT / "examples" / "cli" / "train.py"
CLI_CONFIG = REPO_ROOT / "examples" / "cli" / "config.yaml"
GPU_CONFIG = REPO_ROOT / "examples" / "cli" / "gpu.yaml"
# The strategy's own arguments (sp_size first), then every DeepSpeedStrategy argument its **kwargs forwards.
STRATEGY_ARGS = [
    name
    for cls in (UlyssesDeepSpeedStrategy, DeepSpeedStrategy)
    for name, param in inspect.signature(cls.__init__).parameters.items()
    if name != "self" and param.kind is not inspect.Parameter.VAR_KEYWORD
]
# Small and fast: a few steps of a 1-layer model on 64-token sequences.
TINY = ["--trainer.max_steps=3", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.hidden_size=32", "--model.layers=1", "--data.seq_len=64", "--data.corpus_mb=1"]


@pytest.fixture(scope="module")
def cli_module():
    import examples.cli.train

    return examples.cli.train


@pytest.fixture
def restore_environ(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(CLI_SCRIPT)])  # LightningCLI(args=...) warns about pytest's own argv
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)  # seed_everything and the Trainer leave PL_GLOBAL_SEED & co. behind


def build(cli_module, args: list[str]):
    return cli_module.main(args=["--seed_everything=0", *args, "--trainer.logger=false"], run=False).trainer.strategy


# ----------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("strategy_flag", ["UlyssesDeepSpeedStrategy", "lightning_ulysses.UlyssesDeepSpeedStrategy"])
def test_flags_build_the_strategy_with_the_given_args(cli_module, restore_environ, strategy_flag):
    strategy = build(cli_module, [
        f"--trainer.strategy={strategy_flag}", "--trainer.strategy.sp_size=2", "--trainer.strategy.stage=3",
        "--trainer.strategy.offload_optimizer=true", "--trainer.strategy.sdpa_per_document=true",
        "--trainer.strategy.tiled_mlp=auto", "--trainer.strategy.tiled_loss=8",
        "--trainer.strategy.ring_size=2", "--trainer.strategy.check_sp_agreement=false",
        "--trainer.strategy.verify_checkpoints=false",
        "--trainer.accelerator=cpu", "--trainer.devices=2",
    ])
    assert type(strategy) is UlyssesDeepSpeedStrategy
    assert strategy.sp_size == 2 and strategy.sdpa_per_document is True
    assert strategy.ring_size == 2 and strategy.check_sp_agreement is False and strategy.verify_checkpoints is False
    assert (strategy.memory_features.tiled_mlp, strategy.memory_features.tiled_loss) == ("auto", 8)
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert strategy.num_processes == 2


def test_yaml_builds_the_strategy_with_the_given_args(cli_module, restore_environ, tmp_path):
    config = tmp_path / "ulysses.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  strategy: {class_path: lightning_ulysses.UlyssesDeepSpeedStrategy, init_args: {sp_size: 2, stage: 1}}\n"
    )
    strategy = build(cli_module, [f"--config={config}"])
    assert type(strategy) is UlyssesDeepSpeedStrategy
    assert strategy.sp_size == 2 and strategy.config["zero_optimization"]["stage"] == 1
    # The shipped example config, with a flag on top of it.
    strategy = build(cli_module, [f"--config={CLI_CONFIG}", "--trainer.strategy.stage=3"])
    assert strategy.sp_size == 2 and strategy.config["zero_optimization"]["stage"] == 3


def test_registry_name_alone_and_its_limit(cli_module, restore_environ, capsys):
    strategy = build(cli_module, ["--trainer.strategy=ulysses_deepspeed_stage_3", "--trainer.accelerator=cpu",
                                  "--trainer.devices=2"])
    assert type(strategy) is UlyssesDeepSpeedStrategy
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.sp_size == 2  # sp_size=None: all devices of the node
    # Documented in the README: jsonargparse resolves `--trainer.strategy.<arg>` only for a class, not for a
    # registry name. If this starts to work, update the Lightning CLI section of docs/launching.md.
    with pytest.raises(SystemExit):
        build(cli_module, ["--trainer.strategy=ulysses_deepspeed", "--trainer.strategy.sp_size=2"])
    assert "Does not validate against any of the Union subtypes" in capsys.readouterr().err


def test_print_config_lists_every_strategy_argument(cli_module, restore_environ, capsys):
    assert STRATEGY_ARGS[0] == "sp_size" and "stage" in STRATEGY_ARGS and "offload_optimizer" in STRATEGY_ARGS
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(args=["fit", f"--config={CLI_CONFIG}", "--config", str(GPU_CONFIG), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    block = printed.split("    init_args:\n", 1)[1]
    keys = re.findall(r"^      (\w+):", block, flags=re.MULTILINE)
    assert keys[: len(STRATEGY_ARGS)] == STRATEGY_ARGS  # all of them, sp_size first, in signature order
    assert "class_path: lightning_ulysses.UlyssesDeepSpeedStrategy" in printed
    assert re.search(r"^      sp_size: null$", block, flags=re.MULTILINE)  # the GPU overlay: one SP group per node
    assert re.search(r"^  accelerator: gpu$", printed, flags=re.MULTILINE)
    assert re.search(r"^  seq_len: 16384$", printed, flags=re.MULTILINE)


def test_strategy_help_shows_every_argument_with_its_type(cli_module, restore_environ, capsys):
    with pytest.raises(SystemExit):
        cli_module.main(args=["fit", "--trainer.strategy.help", "UlyssesDeepSpeedStrategy"])
    text = capsys.readouterr().out
    # One block per option: "  --trainer.strategy.NAME ..." up to the next option.
    blocks = dict(re.findall(r"^  --trainer\.strategy\.(\w+) [^\n]*\n(.*?)(?=^  --|\Z)", text, re.MULTILINE | re.S))
    assert set(STRATEGY_ARGS) <= set(blocks), set(STRATEGY_ARGS) - set(blocks)
    blocks = {name: " ".join(block.split()) for name, block in blocks.items()}  # undo the line wrapping
    for name in STRATEGY_ARGS:
        assert "(type: " in blocks[name], name
    assert "(type: Union[int, str, null], default: null)" in blocks["sp_size"]  # a number, None or "auto"
    assert "(type: int, default: 2)" in blocks["stage"]
    assert "(type: bool, default: False)" in blocks["sdpa_per_document"]
    assert "(type: Union[str, Path, dict[str, Any], null], default: null)" in blocks["config"]


# ----------------------------------------------------------------------------------------------- training
def run_cli(args: list[str], cwd: Path, report_dir: Path) -> list[dict]:
    """``python examples/cli/train.py fit ARGS`` as one process: Lightning starts the second one itself."""
    cmd = [sys.executable, str(CLI_SCRIPT), "fit", *args, "--trainer.callbacks+=tests.scenarios.launchers.LaunchReport",
           f"--trainer.callbacks.out_dir={report_dir}"]
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"CLI failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    reports = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return reports


def check_sp2_training(reports: list[dict], stage: int) -> None:
    for rank, report in enumerate(reports):
        assert report["strategy_class"] == "lightning_ulysses.strategy.UlyssesDeepSpeedStrategy"
        assert (report["requested_sp_size"], report["sp_size"], report["stage"]) == (2, 2, stage)
        assert (report["world_size"], report["global_rank"], report["sp_group"]) == (2, rank, [0, 1])
        assert report["global_step"] == 3 and len(report["losses"]) == 3
        assert report["input_shapes"] == [[1, 64 // 2]] * 3  # each rank holds half of every 64-token sequence
        assert all(0 < loss < 10 for loss in report["losses"])
    assert reports[0]["losses"] == reports[1]["losses"]  # the full-sequence loss, the same on both SP ranks
    # Lightning's own launcher: rank 0 is the process we started, rank 1 its child.
    assert reports[0]["cluster_environment"] == "LightningEnvironment"
    assert reports[0]["launcher"] == "_SubprocessScriptLauncher"
    assert reports[1]["ppid"] == reports[0]["pid"]


def test_cli_flags_train_sp2_with_lightnings_launcher(tmp_path):
    reports = run_cli([
        "--seed_everything=0",
        "--trainer.strategy=UlyssesDeepSpeedStrategy", "--trainer.strategy.sp_size=2", "--trainer.strategy.stage=3",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}", *TINY,
    ], cwd=tmp_path, report_dir=tmp_path / "report")
    check_sp2_training(reports, stage=3)


def test_cli_yaml_trains_sp2_and_logs(tmp_path):
    reports = run_cli([f"--config={CLI_CONFIG}", *TINY, "--trainer.log_every_n_steps=1"], cwd=tmp_path,
                      report_dir=tmp_path / "report")
    check_sp2_training(reports, stage=2)
    # The config's CSVLogger (save_dir examples/out, relative to the working directory) got the run and its config.
    version = tmp_path / "examples" / "out" / "cli" / "version_0"
    saved = (version / "config.yaml").read_text()
    assert "class_path: lightning_ulysses.UlyssesDeepSpeedStrategy" in saved and "sp_size: 2" in saved
    with open(version / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train_loss")]
    assert [float(row["train_loss"]) for row in rows] == pytest.approx(reports[0]["losses"], rel=1e-6)

"""No state leaks out of the strategy: an epoch with a smaller last batch, then validate, test and a second Trainer's
fit in the same process, at ZeRO 2 and 3; the model is a plain Hugging Face model again between runs."""

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import TokenDataset, build_llama, tiny_llama_config, train_single_device

NUM_ROWS, SEQ_LEN, BATCH = 5, 32, 2  # batches of 2, 2 and 1 rows
STEPS = 3


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def lifecycle(request):
    return launch(2, "lifecycle:run", {"stage": request.param, "num_rows": NUM_ROWS, "seq_len": SEQ_LEN,
                                   "batch_size": BATCH})


@pytest.fixture(scope="module")
def reference():
    config = tiny_llama_config(num_kv_heads=2)
    dataset = TokenDataset(NUM_ROWS, SEQ_LEN)
    trained = train_single_device(config, dataset, BATCH, STEPS)
    model = build_llama(config)
    model.load_state_dict(trained["weights"], strict=False)
    # Lightning's epoch-level value of a logged loss: mean of the batch losses weighted by batch size.
    with torch.no_grad():
        batches = [dataset.rows[i:i + BATCH] for i in range(0, NUM_ROWS, BATCH)]
        losses = [model(input_ids=b, labels=b).loss.item() for b in batches]
    val = sum(l * len(b) for l, b in zip(losses, batches)) / NUM_ROWS
    return {"losses": trained["losses"], "val_loss": val}


def test_epoch_with_smaller_last_batch_matches_single_device(lifecycle, reference):
    for rank in lifecycle:
        assert rank["input_shapes"] == [(2, SEQ_LEN // 2), (2, SEQ_LEN // 2), (1, SEQ_LEN // 2)]
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_validate_and_test_after_fit_give_the_single_device_loss(lifecycle, reference):
    for rank in lifecycle:
        assert rank["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
        assert rank["test_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


def test_model_is_plain_again_after_fit(lifecycle):
    for rank in lifecycle:
        assert rank["restored"] == {"attn_implementation": "sdpa", "has_sp_loss": False, "use_cache": True}


def test_no_patch_outlives_a_stage(lifecycle):
    """Every change the strategy makes (models, loaders, library functions) is in effect during fit and undone after
    fit, validate, test, predict and a fit whose step raised; the failed fit's model is plain again, and the loader
    object handed to predict keeps its own collate function."""
    for rank in lifecycle:
        seen = rank["patches_during_fit"]
        assert any("Ulysses attention and SP loss" in name for name in seen), seen
        assert any("sequence-sharding collate" in name for name in seen), seen
        assert rank["patches_left"] == {"fit": [], "validate": [], "test": [], "predict": [], "failed fit": []}
        assert rank["failure"] is not None and "the user's step failed" in rank["failure"]
        assert rank["failed_model_plain"] == {"attn_implementation": "sdpa", "has_sp_loss": False, "use_cache": True}
        assert rank["predict_loader_untouched"]


@pytest.mark.parametrize("stage, measured", [(2, 2), (3, 4)])  # expected D: dp = 1 at ZeRO 2, dp × sp = 2 at ZeRO 3
def test_a_change_in_deepspeeds_gradient_averaging_stops_the_run_at_set_up(stage, measured):
    """Mutation: DeepSpeed's averaged gradients halved (ZeRO 2: ``average_tensor``; ZeRO 3: its gradient
    reduce-scatter). The set-up probe measures the divisor and stops the fit before its first step, on every rank."""
    for rank in launch(2, "lifecycle:probe_mutation", {"stage": stage}):
        assert rank["error"] is not None and f"divides the sum of the ranks' gradients by {measured} " in rank["error"], rank
        assert rank["steps"] == 0
        assert rank["patches_left"] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_a_step_does_not_use_stays_put(stage):
    """A parameter used in step 1 only moves in step 1 (SGD, lr 0.5, gradient 1 per entry) and not in steps 2 and 3,
    as on one device. Without the clearing of ZeRO-3's gradient partitions it moved 0.5 in every step at ZeRO 3."""
    for rank in launch(2, "lifecycle:unused_parameter", {"stage": stage}):
        assert rank["moves"][0] == pytest.approx(0.5, rel=1e-6)
        assert rank["moves"][1:] == [0.0, 0.0]


def test_second_trainer_trains_in_the_same_process(lifecycle):
    for rank in lifecycle:
        assert len(rank["second_fit_losses"]) == 2
        assert all(torch.isfinite(torch.tensor(rank["second_fit_losses"])))
    assert lifecycle[0]["second_fit_losses"] == lifecycle[1]["second_fit_losses"]


def test_step_progress_bar_counts_optimizer_steps_across_epochs(capsys):
    """StepProgressBar: a run shows "Step" with optimizer steps out of its total, continuing across epochs (3
    batches per epoch, max_steps 7: the bar ends at 7/7, not at the last epoch's 1/3; with max_epochs ending the run
    first and accumulation, 4/4)."""
    from lightning.pytorch import LightningModule, Trainer

    from lightning_ulysses import StepProgressBar

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(3, 2), batch_size=1)

    seen = []

    class Recording(StepProgressBar):
        def on_train_end(self, trainer, pl_module):
            bar = self.train_progress_bar
            seen.append((bar.n, bar.total, bar.desc))
            super().on_train_end(trainer, pl_module)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=7, callbacks=[Recording()], logger=False,
                      enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Tiny())
    assert trainer.current_epoch >= 2  # three epochs ran: the bar had to continue across them
    assert seen == [(7, 7, "Step: ")]
    shown = capsys.readouterr()
    assert "Step: 100%" in shown.out and "Epoch" not in shown.out + shown.err
    # max_epochs ends the run before max_steps (2 epochs of 3 batches, accumulating 2 of them: 2 steps per epoch)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=100, max_epochs=2, accumulate_grad_batches=2,
                      callbacks=[Recording()], logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Tiny())
    assert seen[-1] == (4, 4, "Step: ")

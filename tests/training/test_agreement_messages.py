"""The SP peers' loss check's messages: what they blame depends on what the strategy checked before."""

from lightning_ulysses.training.agreement import loss_mismatch_message


def test_loss_mismatch_names_the_model_when_the_model_form_check_was_off():
    checked = loss_mismatch_message([0, 1], "training step", 1.0, 2.0)
    unchecked = loss_mismatch_message([0, 1], "training step", 1.0, 2.0, model_form_checked=False)
    assert "model-form check is off" not in checked
    # with the check off, a model that numbers its positions from its shard gives a different loss on every rank
    # whatever the loss code: the message says so before it lists the loss code's usual causes
    assert "model-form check is off" in unchecked and "torch.arange(T)" in unchecked
    assert unchecked.index("model-form check is off") < unchecked.index("Likely code")

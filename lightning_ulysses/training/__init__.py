"""The step and its loss: the step runner, the gradient factors, the SP losses, the SP-peer agreement checks, the
training callbacks."""

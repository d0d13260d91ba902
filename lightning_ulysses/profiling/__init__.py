"""Measuring what a run keeps: live tensor bytes per step, tensor by tensor."""

"""A GPU's host copies, emulated on a CPU for memory counts: the bytes a copy to pinned host memory takes off the
device leave torch here (a NumPy copy), and the copy back is a new tensor (a device allocation), so that
``TensorMemoryTracker`` counts what a GPU's allocator would. Used by ``plan_accuracy.py`` and
``offload_attention_memory.py`` (the strategy keeps host tensors in place on a CPU, where host and device are one)."""

from __future__ import annotations


def to_host(tensor):
    import ctypes

    import numpy

    # the bytes copied into a NumPy array straight from memory: no torch allocation (the tracker would count it) and
    # no .numpy() (which marks the tensor's storage as not resizable: the layer checkpoint frees some in place)
    tensor = tensor.detach().contiguous()
    host = numpy.empty(tensor.numel() * tensor.element_size(), dtype=numpy.uint8)
    ctypes.memmove(host.ctypes.data, tensor.data_ptr(), host.nbytes)
    return tensor.dtype, tensor.shape, host


def to_device(handle):
    import torch

    dtype, shape, host = handle
    return torch.from_numpy(host).view(dtype).view(shape).clone()  # the copy back: a device allocation


def checkpoints_on_a_host() -> None:
    """``offload_checkpoints`` as on an accelerator: each saved tensor leaves the device, comes back in backward."""
    import torch

    from lightning_ulysses.models import memory

    memory._offload_to_host = lambda: torch.autograd.graph.saved_tensors_hooks(to_host, to_device)


def attention_chunks_on_a_host() -> None:
    """``offload_attention``'s chunk store as on CUDA: a stored chunk leaves the device, comes back when fetched."""
    from lightning_ulysses.parallel import offload_attention

    class HostStore:
        offloads = True

        def __init__(self, device):
            pass

        put, fetch = staticmethod(to_host), staticmethod(to_device)

        def ready(self, fetched):
            return fetched

        def release(self, handle):
            pass

    offload_attention.ChunkStore = HostStore

"""The DP×SP layout of the world: one object owns the device mesh ``("dp", "ring", "ulysses")`` (``"sp"`` is its
flattened ``ring × ulysses`` part; ``ring_size = 1`` is the plain Ulysses case, not a special one), the groups, the
ranks and the sequence geometry (:class:`~lightning_ulysses.parallel.geometry.SequenceGeometry`); everything else asks
it.

Ranks are laid out with SP innermost (and Ulysses innermost inside SP): global rank ``r`` sits at
``(dp_rank, sp_rank) = divmod(r, sp_size)``, so the ranks ``[k * sp_size, (k + 1) * sp_size)`` form one SP group.
With the usual one-process-per-device launch, local ranks of a node are consecutive global ranks, so an SP group stays
inside a node whenever ``sp_size`` divides the number of devices per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ulysses.parallel.geometry import SequenceGeometry

DP_DIM = "dp"
SP_DIM = "sp"
RING_DIM = "ring"
ULYSSES_DIM = "ulysses"


def validate_sp_size(sp_size: int, world_size: int) -> None:
    """Raise a ``ValueError`` naming what to change if ``sp_size`` cannot split ``world_size`` processes."""
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"`sp_size` must be a positive integer, got {sp_size!r}.")
    if sp_size > world_size:
        raise ValueError(
            f"`sp_size={sp_size}` is larger than the world size ({world_size} processes = num_nodes × devices)."
            f" Lower `sp_size` to at most {world_size}, or launch more devices."
        )
    if world_size % sp_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"The world size ({world_size} processes) is not divisible by `sp_size={sp_size}`:"
            f" every data-parallel replica needs a full SP group. Choose `sp_size` from {divisors},"
            f" or change the number of devices to a multiple of {sp_size}."
        )


def validate_ring_size(ring_size: int, sp_size: int) -> None:
    """Raise a ``ValueError`` naming what to change if ``ring_size`` cannot split an SP group of ``sp_size``."""
    if not isinstance(ring_size, int) or isinstance(ring_size, bool) or ring_size < 1:
        raise ValueError(f"`ring_size` must be a positive integer, got {ring_size!r}.")
    if sp_size % ring_size != 0:
        divisors = [d for d in range(1, sp_size + 1) if sp_size % d == 0]
        raise ValueError(
            f"`ring_size={ring_size}` does not divide `sp_size={sp_size}`: the SP group is ring_size ring groups of"
            f" sp_size / ring_size Ulysses ranks. Choose `ring_size` from {divisors}."
        )


def sp_groups_span_nodes(sp_size: int, devices_per_node: int, num_nodes: int) -> bool:
    """Whether some SP group holds ranks of two nodes, for node-contiguous global ranks (``node * devices + local``,
    as Lightning's launcher, torchrun and SLURM number them) and SP innermost.

    The groups are ``[k * sp_size, (k + 1) * sp_size)`` and the node boundaries ``m * devices_per_node``; no boundary
    falls inside a group exactly when ``sp_size`` divides ``devices_per_node``. One node never spans anything.
    """
    return num_nodes > 1 and devices_per_node % sp_size != 0


def node_spanning_warning(sp_size: int, devices_per_node: int, num_nodes: int, ring_size: int = 1) -> str:
    """The message for :func:`sp_groups_span_nodes`: which group crosses which node boundary, and what to change.
    ``sp_size`` is the size of the all-to-all group (the Ulysses part ``sp_size / ring_size`` with ring attention)."""
    if not sp_groups_span_nodes(sp_size, devices_per_node, num_nodes):
        raise ValueError(f"SP groups of {sp_size} ranks stay inside nodes of {devices_per_node} devices: nothing to warn.")
    boundary = next(m * devices_per_node for m in range(1, num_nodes) if (m * devices_per_node) % sp_size != 0)
    first = boundary // sp_size * sp_size
    divisors = [d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0]
    size = f"`sp_size={sp_size}`" if ring_size == 1 else f"the Ulysses size `sp_size / ring_size = {sp_size}`"
    return (
        f"Sequence-parallel groups span nodes: {size} does not divide the {devices_per_node} devices per"
        f" node ({num_nodes} nodes), so e.g. the all-to-all group of global ranks {first}..{first + sp_size - 1} has ranks on"
        f" node {first // devices_per_node} and node {boundary // devices_per_node}. Training is still exact, but every"
        " attention layer then runs its all-to-alls over the inter-node network, which is typically many times slower"
        f" than the links inside a node. Choose `sp_size` from {divisors} (SP inside each node, data parallelism"
        " across nodes), or leave `sp_size=None` for all devices of a node."
    )

def group_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """How many ranks ``group`` holds (the default group when ``None``), 1 without an initialised process group.
    The one place outside the layout's construction where the package asks torch.distributed for a size: a
    sequence-parallel group is the layout's, and the collectives that take one ask here."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_members(group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """The global ranks ``group`` holds (the default group when ``None``), in its own rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def group_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This rank's place in ``group`` (the default group when ``None``), 0 without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


@dataclass(frozen=True)
class SequenceParallelLayout:
    """The data-parallel × sequence-parallel split of the world, built once the process group exists.

    Attributes:
        mesh: 3-D :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "ring", "ulysses")``, Ulysses
            innermost (a Ulysses group is ``sp_size / ring_size`` consecutive ranks).
        sp_mesh: the 1-D ``"sp"`` mesh, ``ring × ulysses`` flattened (kept here: PyTorch deprecates slicing a
            flattened dimension from the root mesh).
        geometry: how rows are cut over the SP group (padded length, shard positions, zigzag order).
        sp_rank: This rank's position inside its SP group (which sequence shard it holds).
        dp_rank: Index of this rank's SP group (which samples it reads).
    """

    mesh: DeviceMesh
    sp_mesh: DeviceMesh
    geometry: SequenceGeometry
    sp_rank: int
    dp_rank: int

    @classmethod
    def build(cls, device_type: str, sp_size: int, ring_size: int = 1) -> "SequenceParallelLayout":
        """Create the mesh on every rank (a collective: all ranks must call it)."""
        world_size = dist.get_world_size()
        validate_sp_size(sp_size, world_size)
        validate_ring_size(ring_size, sp_size)
        geometry = SequenceGeometry(sp_size, ring_size)
        mesh = init_device_mesh(device_type, (world_size // sp_size, ring_size, geometry.ulysses_size),
                                mesh_dim_names=(DP_DIM, RING_DIM, ULYSSES_DIM))
        sp_mesh = mesh[RING_DIM, ULYSSES_DIM]._flatten(SP_DIM)  # the SP group: ring × ulysses, as one dimension
        dp_rank, sp_rank = divmod(dist.get_rank(), sp_size)
        assert sp_mesh.get_local_rank() == sp_rank and mesh.get_local_rank(DP_DIM) == dp_rank
        assert (mesh.get_local_rank(RING_DIM), mesh.get_local_rank(ULYSSES_DIM)) == geometry.ring_and_ulysses_rank(
            sp_rank)
        return cls(mesh=mesh, sp_mesh=sp_mesh, geometry=geometry, sp_rank=sp_rank, dp_rank=dp_rank)

    @property
    def sp_size(self) -> int:
        """Number of ranks that share one sequence."""
        return self.geometry.sp_size

    @property
    def ring_size(self) -> int:
        """Ring groups per SP group (hybrid Ulysses × ring); 1: Ulysses only."""
        return self.geometry.ring_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (``world_size // sp_size``)."""
        return self.mesh.size(0)

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        """The consecutive ranks whose all-to-all swaps sequence for heads (the whole SP group when ring_size=1)."""
        return self.mesh.get_group(ULYSSES_DIM)

    @property
    def ring_group(self) -> dist.ProcessGroup:
        """The ranks with the same Ulysses rank across the ring groups of this SP group (this rank alone when
        ring_size=1)."""
        return self.mesh.get_group(RING_DIM)

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the shards of the same sequences (all-to-all around attention, loss sums)."""
        return self.sp_mesh.get_group()

    def sp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's SP group, in sequence-shard order."""
        start = self.dp_rank * self.sp_size
        return list(range(start, start + self.sp_size))

    def deepspeed_mpu(self) -> "DeepSpeedSequenceParallelGroups":
        """The ``mpu`` object to hand to ``deepspeed.initialize``."""
        return DeepSpeedSequenceParallelGroups(self)


class DeepSpeedSequenceParallelGroups:
    """The ``mpu`` interface DeepSpeed expects for Ulysses SP, backed by a :class:`SequenceParallelLayout`.

    It mirrors ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (which owns process-global groups that can be
    created only once per process). DeepSpeed recognises an SP-only ``mpu`` by its ``initialize_sequence_parallel``
    attribute; with it:

    * ``DeepSpeedConfig`` uses ``world_size / sp_size`` = dp for the batch arithmetic
      (``train_batch_size = micro_batch × accumulation × dp``);
    * ZeRO partitions and reduces gradients over the sequence-data-parallel group, which is every rank (DP×SP), so the
      SP peers' partial gradients are summed and the replicas averaged.
    """

    def __init__(self, layout: SequenceParallelLayout) -> None:
        self._layout = layout
        self._single_rank_group: Optional[dist.ProcessGroup] = None

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:  # marker read by DeepSpeed
        raise RuntimeError("The groups are owned by UlyssesDeepSpeedStrategy's layout; they are never re-created.")

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self._layout.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self._layout.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self._layout.sp_rank

    def get_sequence_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # No tensor parallelism: weights are whole on every rank. DeepSpeed's checkpoint save asks every mpu for its TP
    # degree (without the SP-only guard it uses elsewhere) and fails on an mpu that cannot answer. DeepSpeed's own
    # parallel_state_sp answers with the SP group, which would record sp as a TP degree in the checkpoint.
    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    # No model parallelism either. DeepSpeed's ZeRO-0 gradient clipping sums the squared norm over the model-parallel
    # group; under SP every rank already holds the whole (reduced) gradient, so that group must be this rank alone.
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        if self._single_rank_group is None:  # collective: every rank gets here in the same clipping call
            self._single_rank_group, _ = dist.new_subgroups(group_size=1)
        return self._single_rank_group

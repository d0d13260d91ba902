"""Ulysses sequence parallelism for PyTorch Lightning + DeepSpeed.

``Trainer(strategy=UlyssesDeepSpeedStrategy(sp_size=4), devices=8)``: each sequence is split over 4 devices, the
training is the one a single device would run. Importing this package registers the strategy names
``ulysses_deepspeed`` and ``ulysses_deepspeed_stage_{1,2,3}`` in Lightning's ``StrategyRegistry`` and in Fabric's
(``L.Fabric(strategy=lightning_ulysses.fabric.UlyssesDeepSpeedStrategy(sp_size=4))`` for Fabric scripts).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ulysses.checkpoint.export import export_checkpoint
from lightning_ulysses.checkpoint.markers import checkpoint_status, find_last_complete_checkpoint
from lightning_ulysses.data.fingerprint import batch_fingerprint
from lightning_ulysses.data.sharding import SequenceShardingCollate, shard_batch
from lightning_ulysses.evaluation.metrics import PositionalLoss, TokenWeightedLoss, TokenWeightedPerplexity
from lightning_ulysses.evaluation.retrieval import PasskeyRetrieval, passkey_sample, run_passkey_grid
from lightning_ulysses.models.generation import GenerationRendezvousError
from lightning_ulysses.parallel.attention import UlyssesAttention, ulysses_attention
from lightning_ulysses.parallel.layout import SequenceParallelLayout
from lightning_ulysses.parallel.outputs import gather_sequence
from lightning_ulysses.profiling.tensor_memory import StepMemory, TensorMemoryMonitor, TensorMemoryTracker
from lightning_ulysses.strategy import UlyssesDeepSpeedStrategy
from lightning_ulysses.training.agreement import SPLossMismatchError, SPPeerMismatchError
from lightning_ulysses.training.callbacks import SequenceParallelThroughputMonitor, StepProgressBar
from lightning_ulysses.training.loss import sequence_parallel_cross_entropy

UlyssesDeepSpeedStrategy.register_strategies(StrategyRegistry)
import lightning_ulysses.fabric  # noqa: E402,F401  (registers the same names for Lightning Fabric)

__all__ = [
    "GenerationRendezvousError",
    "PasskeyRetrieval",
    "PositionalLoss",
    "SPLossMismatchError",
    "SPPeerMismatchError",
    "SequenceParallelLayout",
    "SequenceParallelThroughputMonitor",
    "SequenceShardingCollate",
    "StepMemory",
    "StepProgressBar",
    "TensorMemoryMonitor",
    "TensorMemoryTracker",
    "TokenWeightedLoss",
    "TokenWeightedPerplexity",
    "UlyssesAttention",
    "UlyssesDeepSpeedStrategy",
    "batch_fingerprint",
    "checkpoint_status",
    "export_checkpoint",
    "find_last_complete_checkpoint",
    "gather_sequence",
    "passkey_sample",
    "run_passkey_grid",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "ulysses_attention",
]
__version__ = "0.1.0"

"""Data parallelism with ZeRO stages 0-3, and Megatron-style tensor parallelism."""
from .tensor import (ColumnParallelLinear, RowParallelLinear, check_tp, tensor_parallel_attention,
                     tensor_parallel_block, tensor_parallel_mlp)
from .zero import STAGES, ZeroDataParallel, bytes_per_step, check_stage, memory_per_rank, storage_bytes

__all__ = ["ZeroDataParallel", "STAGES", "check_stage", "bytes_per_step", "memory_per_rank", "storage_bytes",
           "ColumnParallelLinear", "RowParallelLinear", "check_tp", "tensor_parallel_mlp", "tensor_parallel_attention",
           "tensor_parallel_block"]

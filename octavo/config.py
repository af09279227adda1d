"""Engine configuration as validated dataclasses (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CacheConfig:
    """The paged KV cache. Its size comes from ``kv_cache_memory_bytes`` when
    set, else from ``gpu_memory_utilization`` of free device memory (on CPU:
    of available system memory), else from ``num_blocks`` when forced."""

    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    memory_fraction: float = 0.3
    num_blocks: Optional[int] = None  # overrides the memory budget (tests)
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not (0.0 < self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Bounded waiting queue: the server answers 503/429 beyond it.
    max_waiting_requests: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class ModelConfig:
    model: str
    tokenizer: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: Optional[int] = None  # None: the checkpoint's limit
    seed: int = 0
    device: str = "cpu"
    served_model_name: Optional[str] = None
    # Decode attention: "native" = the C kernel that reads K/V blocks in place
    # (built on first use; CPU), "torch" = gather + SDPA, "auto" = native when
    # it builds and fits the device and dtypes, else torch.
    attention_backend: str = "auto"
    # bf16 matmuls on CPU: "onednn" = weights prepacked once for oneDNN;
    # "native" = the same, plus products of few rows (small-batch decode)
    # through the AMX kernel reading those packed bytes; "torch" = plain
    # F.linear; "auto" = native where the CPU has AMX, else onednn, else torch.
    linear_backend: str = "auto"
    # Native fused kernels for RMSNorm + residual add, SiLU-and-multiply,
    # rotary + K/V cache write and the greedy argmax (CPU; same values as the
    # torch ops). Off, or no C compiler: torch ops.
    fused_ops: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "native", "torch"):
            raise ValueError(
                f"attention_backend must be one of auto, native, torch; got {self.attention_backend!r}"
            )
        if self.linear_backend not in ("auto", "native", "onednn", "torch"):
            raise ValueError(
                f"linear_backend must be one of auto, native, onednn, torch; got {self.linear_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # A lambda: ParallelConfig is defined below (appended, to keep this file's
    # history simple to merge).
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig())


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split over processes. ``tensor_parallel_size`` ranks
    split every layer (heads, MLP columns, vocabulary rows);
    ``pipeline_parallel_size`` stages split the layer stack. World size is
    their product; rank = pp_rank * tensor_parallel_size + tp_rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" = the model in the engine's own process (world size 1 only);
    # "mp" = one spawned worker process per rank on this machine; "ray" = one
    # Ray actor per rank (several machines). None: "uni" for world size 1,
    # else "mp".
    distributed_executor_backend: Optional[str] = None
    # Intra-op threads of each rank's process; None = the cores this process
    # may use, split evenly between the ranks.
    threads_per_worker: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; got {backend!r}"
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}: use 'mp' or 'ray'"
            )
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend in use: the one chosen, else the default for the world size."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

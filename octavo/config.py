"""Engine configuration as validated dataclasses (torch-free).

These fields are the one source of the engine's option names, defaults and
help: the command line generates ``--field-name`` options from them and
``LLM(model, **kwargs)`` takes the same names (``octavo/entrypoints/engine_args.py``).
A field's ``metadata`` holds its help text, and optionally ``choices``,
``unit`` ("bytes": the option takes sizes like 2GiB) and ``aliases`` (older
option spellings that keep working)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = ("float", "half")
ATTENTION_BACKENDS = ("auto", "native", "torch")
LINEAR_BACKENDS = ("auto", "native", "onednn", "torch")


def option(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its command-line help (and choices, unit, aliases)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class CacheConfig:
    """The paged KV cache. Its size comes from ``kv_cache_memory_bytes`` when
    set, else from ``memory_fraction`` of free device memory (on CPU: of
    available system memory), else from ``num_blocks`` when forced."""

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory_bytes: Optional[int] = option(
        None, "KV cache size, e.g. 2GiB (default: memory_fraction of the free memory)",
        unit="bytes", aliases=("--kv-cache-memory",),
    )
    memory_fraction: float = option(0.3, "share of the memory free after loading the weights given to the KV cache")
    num_blocks: Optional[int] = option(None, "force the KV cache block count (testing); overrides the memory budget")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of shared prompt prefixes", aliases=("--prefix-caching",)
    )
    cache_dtype: str = option("auto", "KV cache element type (auto: the model's dtype)", choices=DTYPES)
    kv_events_endpoint: Optional[str] = option(
        None, "publish prefix-cache events (blocks stored/removed) on this ZMQ PUB endpoint, e.g. "
        "tcp://*:5557, for kv-aware routing by `octavo gateway`",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not (0.0 < self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.cache_dtype not in DTYPES + _DTYPE_ALIASES:
            raise ValueError(f"cache_dtype must be one of {', '.join(DTYPES)}; got {self.cache_dtype!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int = option(2048, "most tokens (prompt chunks and decodes) in one step")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps, mixed with decodes")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class ModelConfig:
    model: str = field(metadata={"help": "model folder (default: the built-in model)"})
    tokenizer: Optional[str] = option(None, "tokenizer folder (default: the model folder)")
    dtype: str = option("auto", "weight and activation type (auto: the checkpoint's)", choices=DTYPES)
    max_model_len: Optional[int] = option(None, "context length (default: the checkpoint's limit)")
    seed: int = option(0, "seed of the global sampling RNG (requests without their own seed)")
    device: str = option("cpu", "cpu or cuda")
    served_model_name: Optional[str] = option(None, "the model name clients send (default: the folder name)")
    # "native" is the C kernel that reads K/V blocks in place (built on first
    # use; CPU); "auto" takes it when it builds and fits the device and dtypes.
    attention_backend: str = option(
        "auto", "decode attention: native C kernel over the KV blocks, or torch gather + SDPA",
        choices=ATTENTION_BACKENDS,
    )
    # "native" = onednn plus products of few rows (small-batch decode) through
    # the AMX kernel reading the same packed bytes; "auto" = native where the
    # CPU has AMX, else onednn, else torch.
    linear_backend: str = option(
        "auto", "bf16 matmuls: weights prepacked for oneDNN (onednn), plus the AMX kernel for few-row "
        "products (native), or torch's plain matmul (torch)",
        choices=LINEAR_BACKENDS,
    )
    # Same values as the torch ops; with no C compiler the torch ops run anyway.
    fused_ops: bool = option(True, "native fused kernels for RMSNorm + residual, SiLU * up, rotary + K/V "
                                   "write and the greedy argmax (CPU); off: torch ops")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {self.linear_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split over processes. ``tensor_parallel_size`` ranks
    split every layer (heads, MLP columns, vocabulary rows);
    ``pipeline_parallel_size`` stages split the layer stack. World size is
    their product; rank = pp_rank * tensor_parallel_size + tp_rank."""

    tensor_parallel_size: int = option(1, "ranks that split every layer (heads, MLP columns, vocabulary)",
                                       aliases=("-tp",))
    pipeline_parallel_size: int = option(1, "stages that split the layer stack", aliases=("-pp",))
    distributed_executor_backend: Optional[str] = option(
        None, "uni: the model in the engine's process (one rank only); mp: a worker process per rank on this "
        "machine; ray: a Ray actor per rank (several machines). Default: uni for one rank, else mp",
        choices=EXECUTOR_BACKENDS,
    )
    threads_per_worker: Optional[int] = option(
        None, "intra-op threads of each rank (default: the cores this process may use, split evenly)"
    )

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


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

"""Engine configuration as validated dataclasses (torch-free).

These fields are the one source of the engine's option names, defaults and
help: the command line generates ``--field-name`` options from them and
``LLM(model, **kwargs)`` takes the same names (``octavo/entrypoints/engine_args.py``).
A field's ``metadata`` holds its help text, and optionally ``choices``,
``unit`` ("bytes": the option takes sizes like 2GiB; "tokens": counts like
4k = 4000 or 4K = 4096, as vLLM) and ``aliases`` (older option spellings, and
vLLM's names where the meaning is the same, that keep working)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Optional

from octavo.pooling import POOLING_TYPES

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = ("float", "half")
# What --generation-config takes besides a folder: the model's own file, or none (vLLM's "vllm").
GENERATION_CONFIG_SOURCES = ("auto", "vllm", "none")
ATTENTION_BACKENDS = ("auto", "native", "triton", "torch")
SPARSE_ATTENTION = ("quest",)
# Quantized KV cache element types (fp8 = float8_e4m3fn); "auto" stores the cache_dtype.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
LINEAR_BACKENDS = ("auto", "native", "onednn", "torch")
QUANTIZATIONS = ("int8", "int4", "w8a8")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
QUANTIZED_ACTIVATIONS = ("int8", "float")
LM_HEAD_QUANTIZATIONS = ("auto", "none", "int8", "int4")
# The output layer's path in every causal LM (octavo/model/models/causal_lm.py).
LM_HEAD = "lm_head"


def option(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its command-line help (and choices, unit, aliases: the keys
    octavo/entrypoints/options.py reads). A list or dict default is copied for each instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


def section(cls: type, prefixed: bool = False) -> Any:
    """A config dataclass nested in another. Its fields are options of the same command: under their own names,
    or ``prefixed`` with the section's (``--cache-max-entries`` for ``cache.max_entries``)."""
    return field(default_factory=cls, metadata={"prefixed": prefixed})


@dataclass
class CacheConfig:
    """The paged KV cache. Its size comes from ``kv_cache_memory_bytes`` when
    set, else from ``memory_fraction`` of free device memory (on CPU: of
    available system memory), else from ``num_blocks`` when forced."""

    block_size: int = option(16, "tokens per KV cache block", unit="tokens")
    kv_cache_memory_bytes: Optional[int] = option(
        None, "KV cache size, e.g. 2GiB (default: memory_fraction of the free memory)",
        unit="bytes", aliases=("--kv-cache-memory",),
    )
    memory_fraction: float = option(
        0.3, "share of the memory free after loading the weights given to the KV cache",
        aliases=("--gpu-memory-utilization",), unit="fraction",
    )
    num_blocks: Optional[int] = option(None, "force the KV cache block count (testing); overrides the memory budget")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of shared prompt prefixes", aliases=("--prefix-caching",)
    )
    cache_dtype: str = option("auto", "KV cache element type (auto: the model's dtype)", choices=DTYPES + _DTYPE_ALIASES)
    # One byte per element plus a float32 scale per token and KV head: ~2x the
    # tokens of a bf16 pool in the same memory, and half the bytes a decode reads.
    kv_cache_dtype: str = option(
        "auto", "quantized KV cache: int8 or fp8 (e4m3) values with a scale per token and KV head "
        "(per KV head when the checkpoint has k_scale/v_scale); auto: unquantized, in cache_dtype",
        choices=KV_CACHE_DTYPES,
    )
    kv_events_endpoint: Optional[str] = option(
        None, "publish prefix-cache events (blocks stored/removed) on this ZMQ PUB endpoint, e.g. "
        "tcp://*:5557, for kv-aware routing by `octavo gateway`",
    )
    # Tiers below the pool (octavo/kv_offload/): blocks the pool evicts are
    # kept in host memory, then on disk, and loaded back on a prefix hit.
    kv_offload_host_bytes: int = option(
        0, "host memory for KV blocks evicted from the pool, e.g. 4GiB (0: no host tier)", unit="bytes",
    )
    kv_offload_dir: Optional[str] = option(
        None, "folder for KV blocks evicted from the host tier (or from the pool, without one); an engine "
        "started on the same folder reuses them",
    )
    kv_offload_disk_bytes: int = option(
        8 * 2**30, "most bytes of KV block files kept in kv_offload_dir (least recently used deleted first)",
        unit="bytes",
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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.kv_offload_host_bytes, int) or self.kv_offload_host_bytes < 0:
            raise ValueError(f"kv_offload_host_bytes must be an integer >= 0, got {self.kv_offload_host_bytes!r}")
        if not isinstance(self.kv_offload_disk_bytes, int) or self.kv_offload_disk_bytes <= 0:
            raise ValueError(f"kv_offload_disk_bytes must be an integer > 0, got {self.kv_offload_disk_bytes!r}")
        if self.kv_offload_dir == "":
            raise ValueError("kv_offload_dir must be a folder path, got an empty string")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_bytes and kv_offload_dir keep prefix-cache blocks; "
                             "they need enable_prefix_caching")
        if self.kv_cache_dtype != "auto" and self.cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} sets the cache's element type; "
                f"cache_dtype must then be auto, got {self.cache_dtype!r}"
            )

    @property
    def kv_offload_enabled(self) -> bool:
        """Whether any tier below the pool is configured."""
        return self.kv_offload_host_bytes > 0 or self.kv_offload_dir is not None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int = option(2048, "most tokens (prompt chunks and decodes) in one step", unit="tokens")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps, mixed with decodes")
    step_record: Optional[str] = option(None, "append a JSON line per engine step (its scheduled work, when it "
                                              "started, its seconds) to this file: what `octavo simulate calibrate "
                                              "--served-steps` fits a served engine's steps to")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        record_dir = None if self.step_record is None else os.path.dirname(os.path.abspath(self.step_record))
        if record_dir is not None and not os.path.isdir(record_dir):
            # Checked here, not when the engine process opens it: a bad path is the caller's one-line error.
            raise ValueError(f"step_record: the folder of {self.step_record!r} does not exist")


@dataclass
class ModelConfig:
    model: str = field(metadata={"help": "model folder, GGUF file or hub id (default: smollm2-135m-instruct, fetched on first use; octavo-mini: the shipped test model)"})
    tokenizer: Optional[str] = option(None, "tokenizer folder (default: the model folder)")
    dtype: str = option("auto", "weight and activation type (auto: the checkpoint's)", choices=DTYPES + _DTYPE_ALIASES)
    max_model_len: Optional[int] = option(None, "context length (default: the checkpoint's limit)", unit="tokens")
    seed: int = option(0, "seed of the global sampling RNG (requests without their own seed)")
    max_logprobs: int = option(20, "most logprobs (and prompt logprobs) one request may ask for")
    device: str = option("cpu", "cpu or cuda")
    served_model_name: Optional[tuple[str, ...]] = option(
        None, "the model name(s) clients send; responses carry the first (default: the folder name)"
    )
    generation_config: str = option(
        "auto", "where request defaults and stop tokens come from: auto (the model's generation_config.json), "
        "vllm or none (no sampling defaults; stop tokens still the model's), or a folder with a "
        "generation_config.json",
    )
    # "native" is the C kernel that reads K/V blocks in place (built on first
    # use; CPU), "triton" its CUDA counterpart; "auto" takes the first that
    # builds and fits the device and dtypes. A backend registered from outside
    # (octavo.attention.registry) is named here too: the registry checks the name.
    attention_backend: str = option(
        "auto", "decode attention: native C kernel over the KV blocks (CPU), Triton kernel over them (CUDA), "
        "or torch gather + SDPA",
        choices=ATTENTION_BACKENDS,
    )
    # Quest (octavo/attention/quest.py): each decode reads the pages whose keys could score highest for its
    # query, bounded from every page's per-channel key minimum and maximum, plus the first and the last ones.
    sparse_attention: Optional[str] = option(
        None, "decode attention over chosen KV pages only: quest (pages ranked by an upper bound of q.k from "
        "each page's per-channel key minimum and maximum); prefill stays dense. Default: dense",
        choices=SPARSE_ATTENTION,
    )
    sparse_top_pages: int = option(
        64, "sparse_attention: pages a decode reads besides its recent ones, the first page (attention sink) "
        "always among them; contexts of at most sparse_top_pages + sparse_recent_pages pages stay dense",
    )
    sparse_recent_pages: int = option(
        2, "sparse_attention: the last pages (the partial last one included) every decode reads",
    )
    # vLLM's name. Graphs need the triton backend, one rank and no speculation; elsewhere steps run eagerly anyway.
    enforce_eager: bool = option(
        False, "run every step eagerly: never replay recorded decode steps (CUDA graphs on a GPU, kernel tapes on CPU)"
    )
    # "native" = on AMX CPUs onednn plus products of few rows (small-batch
    # decode) through the AMX kernel reading the same packed bytes; on other
    # CPUs Octavo's few-row kernel plus, for more rows, the way a measured
    # table picks per shape (octavo/quant/linear_table.py). "auto" = native
    # when its kernels build, else onednn, else torch.
    linear_backend: str = option(
        "auto", "bf16 matmuls: weights prepacked for oneDNN (onednn); Octavo's kernels for few-row products "
        "plus, without AMX, a measured choice per shape for more rows (native); or torch's plain matmul (torch)",
        choices=LINEAR_BACKENDS,
    )
    linear_weight_copies: bool = option(
        False, "CPUs without AMX: let the measured choice keep a second copy of a bf16 weight (oneDNN-packed "
               "or float32, up to twice the weight's memory) where it is faster for many rows"
    )
    # Same values as the torch ops; with no C compiler the torch ops run anyway.
    fused_ops: bool = option(True, "native fused kernels for RMSNorm + residual, SiLU * up, rotary + K/V "
                                   "write and the greedy argmax (CPU); off: torch ops")
    quantization: Optional[str] = option(
        None, "quantize the linear layers' weights while loading: int8 (per output channel, symmetric) or "
        "int4 (groups of --quantization-group-size inputs, scales and zero points), activations staying in dtype; "
        "or w8a8: those int8 weights times activations rounded to 8 bits per token on every product "
        "(changes the numerics, for integer dot products: VNNI on AVX-512 CPUs)",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = option(
        128, f"int4: inputs sharing one scale and zero point, one of {QUANTIZATION_GROUP_SIZES}; must divide "
        "every linear layer's in-features"
    )
    # At one row the float kernel is bound by widening each weight to float32;
    # rounding the row to 8 bits lets integer dot products (VNNI, AVX2) take
    # the bytes as they are, with llama.cpp's numerics (its Q8_0 activations).
    quantized_activations: str = option(
        "int8", "int8/int4 weights (on the fly, GGUF, GPTQ, AWQ, compressed-tensors) at few rows (decode): int8 "
        "rounds the activations per block of 32 as llama.cpp's Q8_0 does and multiplies by integer dot products "
        "(the numerics change as llama.cpp's defaults do); float keeps them in dtype (the exact float32 sums)",
        choices=QUANTIZED_ACTIVATIONS,
    )
    unquantized_modules: str = option(
        "", "comma-separated fnmatch patterns of linear layers' checkpoint paths kept unquantized "
        "under --quantization (e.g. 'model.layers.0.*'; empty: none); the embedding never is; a pattern matching "
        "lm_head keeps it unquantized as --lm-head-quantization none does"
    )
    # The output layer turns hidden states into logits directly, so its error is not averaged away by later
    # layers: llama.cpp's Q4_0 files keep it in Q6_K (its Q8_0 files in Q8_0, as int8 does here). In bf16 it is
    # 2.4x the bytes of Q6_K, the largest single read of a small model's decode step. Per-channel int8 measured
    # no perplexity cost over bf16 where int4 groups cost SmolLM2-135M 8.7% (BENCHMARKS.md D2). With tied
    # embeddings an int8 head is a copy beside the float table the embedding keeps (more memory, fewer bytes read
    # per token).
    lm_head_quantization: str = option(
        "auto", "the LM head's weight under --quantization: int8 (per output channel, symmetric), int4 (groups "
        "of --quantization-group-size, as the other layers), none (kept in dtype); auto: int8 under int4 and "
        "int8, none under w8a8",
        choices=LM_HEAD_QUANTIZATIONS,
    )
    # Embedding models (octavo/model/pooler_config.py, octavo/pooling.py): one server serves one task.
    task: str = option(
        "auto", "generate (text) or embed (one vector per input, /v1/embeddings); auto: embed for a checkpoint "
        "without an LM head (e.g. Qwen3Model) or a sentence-transformers folder, else generate",
        choices=("auto", "generate", "embed"),
    )
    pooling_type: Optional[str] = option(
        None, "embed: hidden states pooled into one vector by the last token, their mean, the first (cls) "
        "token, their element-wise max, their sum over sqrt(length) (mean_sqrt_len_tokens), or their mean "
        "weighted 1..n by position (weightedmean), as sentence-transformers' modes (default: the folder's "
        "sentence-transformers Pooling config, else last)",
        choices=POOLING_TYPES,
    )
    normalize: Optional[bool] = option(
        None, "embed: L2-normalize the vectors (default: as the folder's sentence-transformers modules say, "
        "else on)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {self.linear_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if isinstance(self.served_model_name, str):
            self.served_model_name = (self.served_model_name,)
        if self.served_model_name is not None:
            self.served_model_name = tuple(self.served_model_name)
            if not self.served_model_name or not all(isinstance(n, str) and n for n in self.served_model_name):
                raise ValueError(f"served_model_name must be one or more non-empty names, got {self.served_model_name!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations must be one of {', '.join(QUANTIZED_ACTIVATIONS)}; "
                             f"got {self.quantized_activations!r}")
        if self.sparse_attention is not None and self.sparse_attention not in SPARSE_ATTENTION:
            raise ValueError(f"sparse_attention must be one of {', '.join(SPARSE_ATTENTION)} or unset; "
                             f"got {self.sparse_attention!r}")
        for name in ("sparse_top_pages", "sparse_recent_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {QUANTIZATION_GROUP_SIZES}; "
                             f"got {self.quantization_group_size!r}")
        self._check_lm_head_quantization()

    def _check_lm_head_quantization(self) -> None:
        head = self.lm_head_quantization
        if head not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"lm_head_quantization must be one of {', '.join(LM_HEAD_QUANTIZATIONS)}; got {head!r}")
        if head in ("auto", "none"):
            return
        if self.quantization is None:
            # A GGUF or pre-quantized checkpoint brings its head's format with it; a float one is quantized
            # only under --quantization.
            raise ValueError(f"lm_head_quantization {head!r} quantizes the LM head of a float checkpoint while "
                             "it loads, with --quantization: set quantization too, or leave it auto")
        kept = [p for p in self.unquantized_patterns if fnmatch(LM_HEAD, p)]
        if kept:
            raise ValueError(f"lm_head_quantization {head!r} contradicts unquantized_modules pattern {kept[0]!r}, "
                             f"which keeps {LM_HEAD} unquantized")

    @property
    def unquantized_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.unquantized_modules.split(",") if p.strip())

    @property
    def lm_head_format(self) -> Optional[str]:
        """What ``quantization`` makes of the LM head's weight: int8, int4, or None (kept in dtype)."""
        head = self.lm_head_quantization
        if self.quantization is None or head == "none":
            return None
        if head != "auto":
            return head
        if any(fnmatch(LM_HEAD, p) for p in self.unquantized_patterns):
            return None
        return "int8" if self.quantization in ("int4", "int8") else None


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
    # vLLM's name. Whole experts per rank: each rank reads only its experts' weights, and a token's
    # expert products run where the expert is, summed by the all-reduce the block has anyway
    # (octavo/model/layers/moe.py; benchmarks/ep_dispatch.py measured it against an all-to-all).
    enable_expert_parallel: bool = option(
        False, "mixtures of experts: the tensor-parallel ranks hold whole experts (num_experts / "
        "tensor_parallel_size each) instead of a slice of every expert; attention stays split by heads",
    )
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


SPECULATIVE_METHODS = ("none", "ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``octavo/spec_decode/``): a proposer guesses up to
    ``num_speculative_tokens`` next tokens per request and the model verifies
    them in its next step, keeping the output distribution exactly."""

    speculative_method: Optional[str] = option(
        None, "how tokens are proposed: ngram (prompt lookup in the request's own tokens), draft_model "
        "(--speculative-model) or none. Default: draft_model when --speculative-model is given, else none",
        choices=SPECULATIVE_METHODS,
    )
    speculative_model: Optional[str] = option(None, "draft model folder (same tokenizer as the model)")
    num_speculative_tokens: int = option(4, "tokens proposed per request per step (k)")
    # A small draft's LM head is most of its bytes; the target verifies every proposal, so a head cut to the
    # tokens a corpus uses most changes no output (octavo/spec_decode/draft_vocab.py).
    speculative_draft_vocab: Optional[int] = option(
        None, "the draft model's LM head keeps its N most used tokens (ranked in the draft folder's "
        "token_ranks.json; python -m octavo.spec_decode.draft_vocab writes it): cheaper proposals, never of a "
        "token outside them; the output is unchanged. 0: the whole vocabulary. Default: the head size that file "
        "names (octavo-mini-draft: 1024), else the whole vocabulary",
    )
    ngram_min: int = option(1, "shortest suffix the n-gram proposer matches")
    ngram_max: int = option(4, "longest suffix the n-gram proposer matches (tried first)")
    # Whether speculation pays depends on the acceptance rate, the proposer's
    # cost and the batch size (a verification step of a large batch is no
    # longer a weight read): measured, not guessed (octavo/spec_decode/adaptive.py).
    speculative_adaptive: bool = option(
        True, "stop proposing while the measured cost per emitted token is lower without speculation, per "
        "batch size (re-measured now and then)",
    )
    speculative_max_batch_size: Optional[int] = option(
        None, "no proposals in a step where more requests than this decode (default: no limit)"
    )

    def __post_init__(self) -> None:
        if self.speculative_max_batch_size is not None and self.speculative_max_batch_size < 1:
            raise ValueError(f"speculative_max_batch_size must be >= 1, got {self.speculative_max_batch_size}")
        # The method itself is checked where proposers are registered
        # (octavo/spec_decode/registry.py), which may hold more than the built-in ones.
        method = self.speculative_method
        if method == "draft_model" and self.speculative_model is None:
            raise ValueError("speculative_method draft_model needs speculative_model (the draft model folder)")
        if self.speculative_model is not None and method in ("none", "ngram"):
            raise ValueError(f"speculative_model is set but speculative_method is {method!r}")
        if self.speculative_draft_vocab is not None and self.speculative_draft_vocab < 0:
            raise ValueError(f"speculative_draft_vocab must be >= 0, got {self.speculative_draft_vocab}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                f"{self.ngram_max}"
            )

    @property
    def method(self) -> str:
        """The method in use: the one chosen, else draft_model when a draft is given, else none."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft_model" if self.speculative_model is not None else "none"

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots the scheduler reserves past a request's verified positions
        for the proposer's own writes: a draft model's k proposal steps."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    speculative: SpeculativeConfig = section(SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.model.sparse_attention is not None and self.speculative.enabled:
            # A verification row would attend over other pages than decoding its token does: the
            # output distribution would no longer be exactly the model's.
            raise ValueError(f"sparse_attention {self.model.sparse_attention!r} decodes one token per step; "
                             "speculative decoding would verify over other pages than decoding chooses: "
                             "leave speculative_method and speculative_model unset")

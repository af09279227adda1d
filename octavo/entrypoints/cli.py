"""The ``octavo`` command: ``octavo serve [MODEL]`` and ``octavo generate [MODEL]``."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from dataclasses import fields
from typing import Optional, Sequence

from octavo.config import EXECUTOR_BACKENDS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from octavo.server.config import DEFAULT_PUBLIC_ROUTES, ServerConfig
from octavo.server.limits import RequestLimits

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512M' -> 512000000, '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1G, 1000000)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model folder (default: the built-in model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "native", "torch"],
                   help="decode attention: native C kernel over the KV blocks, or torch gather + SDPA")
    p.add_argument("--linear-backend", default="auto", choices=["auto", "native", "onednn", "torch"],
                   help="bf16 matmuls: weights prepacked for oneDNN (onednn), plus the AMX kernel for "
                        "few-row products (native), or torch's plain matmul (torch)")
    p.add_argument("--no-fused-ops", action="store_true",
                   help="torch ops instead of the native fused norm/SiLU/rotary/argmax kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache size, e.g. 2GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="force the KV cache block count (testing)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks that split every layer")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="stages that split the layers")
    p.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTOR_BACKENDS),
                   help="uni: in process; mp: a process per rank (default above one rank); ray")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="intra-op threads per rank (default: the cores split evenly)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=str(_model_path(args.model)),
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            device=args.device,
            attention_backend=args.attention_backend,
            linear_backend=args.linear_backend,
            fused_ops=not args.no_fused_ops,
            served_model_name=getattr(args, "served_model_name", None),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            threads_per_worker=args.threads_per_worker,
        ),
    )


def _model_path(model: Optional[str]) -> str:
    if model is None:
        from octavo.assets import DEFAULT_MODEL_PATH

        model = str(DEFAULT_MODEL_PATH)
    # Checked here so a typo is one line of error, not an engine start-up traceback.
    if not os.path.isdir(model):
        raise ValueError(f"model folder not found: {model}")
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: folder name)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help="require this bearer key; repeat for several (default: $OCTAVO_API_KEY)")
    serve.add_argument(
        "--public-routes",
        default=",".join(DEFAULT_PUBLIC_ROUTES),
        help="comma-separated paths served without the API key (default: %(default)s)",
    )
    serve.add_argument("--max-waiting-requests", type=int, default=None, help="beyond this many pending: 503")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    serve.add_argument("--max-body-size", type=parse_bytes, default=8 * 2**20, help="larger bodies get 413")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--api-key-file", default=None,
                       help="file of bearer keys, one a line (# comments); keeps keys out of the process list")
    serve.add_argument("--metrics-api-key", action="append", default=None,
                       help="/metrics needs this key (repeatable) instead of being public or using --api-key")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept chat_template (and chat_template_kwargs.chat_template) from requests")
    for f in fields(RequestLimits):  # one option per request limit, named after its field
        serve.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} (default: %(default)s)")
    # Defaults from ServerConfig itself, so there is one source for them.
    serve.add_argument("--engine-max-restarts", type=int, default=ServerConfig.engine_max_restarts,
                       help="restart a dead engine up to this many times per window, then exit 1 "
                            "(0: exit at once; default: %(default)s)")
    serve.add_argument("--engine-restart-window", type=float, default=ServerConfig.engine_restart_window_s,
                       help="seconds (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout_s,
                       help="abort requests older than this many seconds (504); default: no limit")

    gen = sub.add_parser("generate", help="generate offline (no server)")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    # Unset sampling options take the model's generation_config.json values,
    # as the server does: tiny models loop under greedy decoding.
    gen.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else off")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    return parser


def _serve(args: argparse.Namespace) -> None:
    from octavo.server.launcher import serve

    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=_api_keys(args),
        public_routes=tuple(r.strip() for r in args.public_routes.split(",") if r.strip()),
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_size,
        log_level=args.log_level,
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)}),
        trust_request_chat_template=args.trust_request_chat_template,
        metrics_api_keys=tuple(args.metrics_api_key or ()),
        engine_max_restarts=args.engine_max_restarts,
        engine_restart_window_s=args.engine_restart_window,
        request_timeout_s=args.request_timeout,
    )
    serve(_engine_config(args), server_config)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key and --api-key-file together; $OCTAVO_API_KEY when neither is given."""
    keys = list(args.api_key or ())
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc.strerror}") from None
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: no keys in {args.api_key_file}")
        keys += file_keys
    if not keys and os.environ.get("OCTAVO_API_KEY"):
        keys.append(os.environ["OCTAVO_API_KEY"])
    return tuple(keys)


def _generate(args: argparse.Namespace) -> None:
    from octavo import LLM, SamplingParams

    llm = LLM(
        _model_path(args.model),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        threads_per_worker=args.threads_per_worker,
    )
    defaults = llm.engine.generation_defaults

    def pick(name: str, fallback: float) -> float:
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    params = SamplingParams(
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", 0)),
        max_tokens=args.max_tokens,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            _serve(args)
        else:
            _generate(args)
    except ValueError as exc:  # bad configuration: a message, not a traceback
        print(f"octavo: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

"""llama.cpp (through llama-cpp-python) as a peer.

Offline, the high-level ``Llama`` API holds one sequence: requests run one
after another (prefill in ``n_batch`` chunks, then one token per decode
call). That is its offline behaviour; llama.cpp batches several sequences
only in its server (see benchmarks/online.py).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from benchmarks.report import PeerResult
from benchmarks.workload import Workload


def gguf_path(model: Path) -> Path:
    """Where tools/make_bench_models.py --gguf puts the converted checkpoint."""
    path = model / "model-bf16.gguf"
    if not path.is_file():
        raise ValueError(
            f"no {path.name} in {model}: run tools/make_bench_models.py --gguf --llama-cpp-src <llama.cpp source>"
        )
    return path


# ggml types (ggml.h) llama-cpp-python names no constant for.
_GGML_TYPES = {"BF16": 30}


def quantized_gguf(source: Path, ftype: str, out_dir: Path, threads: int, pure: bool = False,
                   output_type: Optional[str] = None) -> Path:
    """``source`` (a bf16 GGUF) quantized to ``ftype`` (Q8_0, Q4_0 ...: the
    names llama-quantize takes) by llama.cpp's quantizer
    (llama_model_quantize, what llama-quantize runs) into ``out_dir``; kept
    when it exists. By default llama.cpp keeps the output layer (the tied
    token embedding where there is no separate one) in Q6_K for Q4_0 files;
    ``pure`` (llama-quantize --pure) gives every matrix ``ftype``, like with
    like against an engine that quantizes its lm_head the same way;
    ``output_type`` (a ggml type: BF16, Q8_0 ...; llama-quantize
    --output-tensor-type) gives the output layer that type, like with like
    against an engine that keeps its lm_head so."""
    import llama_cpp

    suffix = ("-pure" if pure else "") + (f"-output-{output_type}" if output_type else "")
    target = out_dir / f"{source.stem.removesuffix('-bf16')}-{ftype}{suffix}.gguf"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.pure = pure
    if output_type is not None:
        name = f"GGML_TYPE_{output_type}"
        params.output_tensor_type = getattr(llama_cpp, name) if hasattr(llama_cpp, name) else _GGML_TYPES[output_type]
    tmp = target.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    tmp.rename(target)
    return target


class LlamaCppPeer:
    name = "llamacpp"

    def __init__(self, model: Path, n_ctx: int, threads: int, n_batch: int = 512,
                 gguf: Optional[Path] = None, extra_bufts: bool = True, flash_attn: bool = False) -> None:
        """``gguf``: the file to run (default: ``model``'s bf16 conversion).
        ``extra_bufts`` False: no repacking of quantized weights into
        llama.cpp's CPU-specific layouts (its use_extra_bufts model
        parameter, which llama-cpp-python does not expose). ``flash_attn``:
        llama.cpp's fused attention (llama-cpp-python leaves it off)."""
        import llama_cpp.llama as high_level
        from llama_cpp import Llama

        self.model_path = model
        self.n_batch = n_batch
        defaults = high_level.llama_cpp.llama_model_default_params

        def model_params():  # Llama() builds its model parameters from this
            params = defaults()
            params.use_extra_bufts = extra_bufts
            return params

        high_level.llama_cpp.llama_model_default_params = model_params
        try:
            self.llm = Llama(model_path=str(gguf or gguf_path(model)), n_ctx=n_ctx, n_batch=n_batch,
                             n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults

    def timed_generate(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        """One greedy request of ``output_len`` tokens: (seconds to its first token, seconds to its last)."""
        start = time.perf_counter()
        first, made = 0.0, 0
        for _ in self.greedy_tokens(prompt):
            made += 1
            if made == 1:
                first = time.perf_counter() - start
            if made == output_len:
                break
        return first, time.perf_counter() - start

    def greedy_tokens(self, prompt: list[int]) -> Iterator[int]:
        """The greedy continuation of ``prompt``, a token per ``next`` (the first one prefills), from an empty
        cache: its context stays held between calls, so decoding can be timed a few tokens at a time."""
        # From an empty cache, as Octavo runs in the comparisons (prefix caching off): Llama.generate
        # would otherwise reuse the KV of whatever prefix the last prompt shares with this one.
        self.llm.reset()
        # top_k=1 with temp=0 is llama.cpp's greedy sampler; EOS is not checked
        # here, so the generator runs for as long as it is asked.
        return self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)

    def warmup(self) -> None:
        self.timed_generate([1, 2, 3, 4], 2)

    def generate(self, workload: Workload) -> None:
        for prompt, n in zip(workload.prompts, workload.output_lens):
            self.timed_generate(prompt, n)

    def generate_each(self, prompts: Sequence[list[int]], output_len: int) -> None:
        """One request after another, ``output_len`` tokens each."""
        for prompt in prompts:
            self.timed_generate(prompt, output_len)

    def run(self, workload: Workload) -> PeerResult:
        start = time.perf_counter()
        self.generate(workload)
        elapsed = time.perf_counter() - start
        return PeerResult(
            peer=self.name, model=self.model_path.name, num_requests=len(workload.prompts),
            prompt_tokens=workload.num_prompt_tokens, output_tokens=workload.num_output_tokens,
            elapsed_s=elapsed, notes=f"llama-cpp-python Llama API, one sequence at a time, n_batch={self.n_batch}",
        )

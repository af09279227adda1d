"""Whether the host KV tier should compress blocks on CPU: zlib on real K/V against a plain copy.

    python -m benchmarks.kv_tier_compression

The shipped model (trained, bf16) reads the held-out text; the blocks its
prompt filled are then copied (what the host tier does) and compressed with
zlib (stdlib; level 1, the fastest), as they are and with the bytes of each
element split into planes first (the high bytes of bf16 hold sign and
exponent, which repeat more). Reports the bytes kept and the throughput of each, in CPU time of one thread.
"""
from __future__ import annotations

import argparse
import time
import zlib

import torch

from octavo import LLM, SamplingParams
from octavo.assets import HELDOUT_SAMPLE_PATH, MINI_MODEL_PATH


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=496, help="prompt tokens whose K/V are measured (the model reads 512 at most)")
    args = parser.parse_args()
    llm = LLM(MINI_MODEL_PATH, dtype="bfloat16", max_model_len=args.tokens + 8)
    prompt = llm.get_tokenizer().encode(HELDOUT_SAMPLE_PATH.read_text())[: args.tokens]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    runner = llm.engine.executor.worker.runner
    blocks = len(prompt) // runner.block_size
    # Blocks are handed out from the front of the pool: the first ones hold the prompt.
    raw = torch.cat([c.data[:, :blocks].reshape(-1).view(torch.uint8) for c in runner.kv_caches])
    data = raw.numpy().tobytes()
    torch.set_num_threads(1)  # one core for each contender; CPU time, not wall time, on a shared machine
    host = torch.empty_like(raw)  # the host tier's buffer is allocated once
    host.copy_(raw)
    start = time.process_time()
    for _ in range(100):
        host.copy_(raw)
    copy_s = (time.process_time() - start) / 100
    planes = raw.view(-1, 2).t().contiguous().numpy().tobytes()
    print(f"{len(data) / 2**20:.1f} MiB of K/V ({blocks} blocks of {runner.block_size} tokens, bf16)")
    print(f"copy: {_rate(len(data), copy_s)}")
    for name, payload in (("zlib-1", data), ("zlib-1, byte planes", planes)):
        start = time.process_time()
        packed = zlib.compress(payload, 1)
        seconds = time.process_time() - start
        print(f"{name}: keeps {100 * len(packed) / len(data):.1f}% of the bytes at {_rate(len(data), seconds)}")


if __name__ == "__main__":
    main()

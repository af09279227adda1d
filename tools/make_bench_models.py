"""Random-weight benchmark checkpoints (and their GGUF copies for llama.cpp).

    python tools/make_bench_models.py        # both random models + a copy of octavo-mini into benchmarks/models/
    python tools/make_bench_models.py --models llama-100m --gguf \\
        --llama-cpp-src /path/to/llama_cpp_python-X/vendor/llama.cpp

The weights are random, so only the shapes matter: throughput depends on the
shape, not on what the model says. Each folder gets a byte-level BPE tokenizer
whose vocabulary is exactly the model's, so every id a model can emit decodes
(benchmarks feed token ids and never rely on the text).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "models"
DEFAULT_MODEL_NAME = "octavo-mini"  # the shipped default model, benchmarked as it is
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class BenchModel:
    name: str
    arch: str  # transformers class prefix: "Qwen2" -> Qwen2Config / Qwen2ForCausalLM
    config: dict[str, Any] = field(default_factory=dict)


BENCH_MODELS: dict[str, BenchModel] = {
    # Exactly Qwen2.5-0.5B's shape (494M parameters, tied embeddings, q/k/v bias).
    "qwen2.5-0.5b": BenchModel("qwen2.5-0.5b", "Qwen2", {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
        "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
    # A ~100M Llama (tied embeddings: 75.5M in the layers + 24.6M embedding).
    "llama-100m": BenchModel("llama-100m", "Llama", {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
        "tie_word_embeddings": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    }),
}


def _synthetic_merges(pieces: list[str], count: int) -> Iterator[tuple[str, str]]:
    """``count`` BPE merges in rank order over ``pieces``: every pair first,
    then pairs followed by one more piece. Training to a 152k vocabulary would
    need a huge corpus; for random-weight models a systematic vocabulary does
    the same job."""
    made = 0
    for a in pieces:
        for b in pieces:
            if made == count:
                return
            yield a, b
            made += 1
    for a in pieces:
        for b in pieces:
            for c in pieces:
                if made == count:
                    return
                yield a + b, c
                made += 1
    raise ValueError(f"vocab_size too large for the synthetic vocabulary: {count} merges")


def _printable_pieces() -> list[str]:
    """Byte-level spellings of printable ASCII (space included). Merging only
    these keeps almost every token valid UTF-8 on its own: a random model
    emits random tokens, and servers that hold back incomplete UTF-8
    (llama-server) would otherwise stream no text at all."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [tok.pre_tokenizer.pre_tokenize_str(chr(b))[0][0] for b in range(32, 127)]


def write_tokenizer(folder: Path, vocab_size: int, max_len: int) -> None:
    """A byte-level BPE with exactly ``vocab_size`` ids; special tokens take the last ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    num_merges = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    if num_merges < 0:
        raise ValueError(f"vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = list(_synthetic_merges(_printable_pieces(), num_merges))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("tokenizer vocabulary does not match the model's")
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_model(spec: BenchModel, out: Path, seed: int = 0) -> Path:
    """Write ``spec`` as a bf16 safetensors checkpoint under ``out``; reuse an existing one."""
    folder = out / spec.name
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        print(f"{folder}: exists, kept")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    vocab = spec.config["vocab_size"]
    eos = vocab - len(SPECIAL_TOKENS)  # <|endoftext|>
    config = getattr(transformers, f"{spec.arch}Config")(
        **spec.config, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{spec.arch}ForCausalLM")(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": [eos, vocab - 1]}, indent=2)
    )
    write_tokenizer(folder, vocab, spec.config["max_position_embeddings"])
    params = sum(p.numel() for p in model.parameters())
    print(f"{folder}: {params / 1e6:.1f}M parameters")
    return folder


def copy_default_model(out: Path) -> Path:
    """The shipped default model, copied so its GGUF lands beside the copy and
    never inside the package's assets."""
    from octavo.assets import MINI_MODEL_PATH

    folder = out / MINI_MODEL_PATH.name
    if not (folder / "model.safetensors").is_file():
        shutil.copytree(MINI_MODEL_PATH, folder, dirs_exist_ok=True)
    print(f"{folder}: copy of {MINI_MODEL_PATH}")
    return folder


def convert_to_gguf(folder: Path, llama_cpp_src: Path, outtype: str = "bf16") -> Path:
    """Convert with the converter that ships in llama.cpp's source tree.

    Its BPE path identifies the pre-tokenizer by hashing how a known text
    tokenizes and refuses unknown tokenizers; ours is synthetic, so it is
    declared GPT-2 style. That choice only affects text tokenization, which
    the benchmarks never use (they send token ids)."""
    target = folder / f"model-{outtype}.gguf"
    if target.is_file():
        print(f"{target}: exists, kept")
        return target
    sys.path.insert(0, str(llama_cpp_src))
    import convert_hf_to_gguf  # noqa: E402  (lives in llama_cpp_src)
    from conversion.base import TextModel  # noqa: E402

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", outtype, "--outfile", str(target)]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=[*sorted(BENCH_MODELS), DEFAULT_MODEL_NAME],
                        default=[*sorted(BENCH_MODELS), DEFAULT_MODEL_NAME])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", action="store_true", help="also write model-bf16.gguf next to each checkpoint")
    parser.add_argument("--llama-cpp-src", type=Path, help="llama.cpp source folder holding convert_hf_to_gguf.py")
    args = parser.parse_args()
    if args.gguf and (args.llama_cpp_src is None or not (args.llama_cpp_src / "convert_hf_to_gguf.py").is_file()):
        raise ValueError("--llama-cpp-src must be a folder containing convert_hf_to_gguf.py when --gguf is given")
    for name in args.models:
        if name == DEFAULT_MODEL_NAME:
            folder = copy_default_model(args.out)
        else:
            folder = make_model(BENCH_MODELS[name], args.out, args.seed)
        if args.gguf:
            convert_to_gguf(folder, args.llama_cpp_src)


if __name__ == "__main__":
    main()

"""Tiny random-weight Hugging Face checkpoints for tests.

``make_tiny_model(tmp_path, arch="llama", **overrides)`` writes a complete model
folder (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json) and returns its path. Weights are seeded, so the same
arguments always give the same model; a folder that already exists for the same
arguments is reused, which keeps session fixtures cheap.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

transformers.utils.logging.disable_progress_bar()

# arch name -> (config class, model class, defaults beyond the common ones)
_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # head_dim 32 with hidden 64 / 4 heads: independent of hidden / heads;
    # query_pre_attn_scalar other than head_dim; soft caps small enough to
    # change the numbers of random weights (the checkpoints' 50 / 30 would not).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 4.0, "num_hidden_layers": 3,
    }),
    # Layers 0, 1 slide with their own rope; layer 2 is global, with linear scaling.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 12}),
    # Mixtures of experts: four to eight experts, two per token; Qwen2-MoE's shared expert and a dense
    # layer (mlp_only_layers), Qwen3-MoE's renormalised top-k.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [1],
    }),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
    }),
    # Latent attention (a 32 + 8 latent per token, heads of 16 + 8 for q.k and 16 for values) and eight
    # experts, two per token, with a shared one; layer 0 dense. Every head is its own KV head; head_dim is
    # the rotary part (transformers sizes its rotary tables by it).
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "num_key_value_heads": 4, "head_dim": 8,
    }),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "num_key_value_heads": 4, "head_dim": 8, "n_group": 4, "topk_group": 2,
    }),
}
# Gemma's norms scale by (1 + weight) and start at zero: random weights make
# every norm (and a wrong one) show in the logits.
_RANDOM_NORMS = {"gemma2", "gemma3"}
# DeepSeek-V3's router bias starts at zero: random, it changes which experts win (and a router that
# ignored it would show).
_RANDOM_ROUTER_BIAS = {"deepseek_v3"}

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    # Larger than HF's 0.02 so logits are peaked: greedy decoding is then not
    # decided by float rounding between near-tied tokens.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}

# Named test models: (arch, config overrides). Small but each exercises a path:
# sliding windows shorter than the prompts, per-layer windows, tied
# embeddings, and every rope scaling with lengths where the scaling matters.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama_rope_llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        },
    ),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "phi3": ("phi3", {}),
    # DeepSeek-V2-Lite's shape (no query LoRA, greedy softmax routing); V2 with a query LoRA and
    # routing within the best 2 of 4 expert groups; V3 (sigmoid scores, a correction bias, groups
    # scored by their best two, renormalised) with YaRN whose mscale_all_dim changes the softmax scale.
    "deepseek_v2_lite": ("deepseek_v2", {}),
    "deepseek_v2": ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4,
                                    "topk_group": 2, "routed_scaling_factor": 1.5}),
    "deepseek_v3": ("deepseek_v3", {
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                            "rope_theta": 10000.0, "mscale": 0.9, "mscale_all_dim": 0.7},
    }),
    # Phi-4-mini's shape: a quarter of each head unrotated, tied embeddings,
    # LongRoPE. Both lengths equal, so the short factors hold at every length
    # (as in transformers); the explicit factor still sets the attention factor.
    # The long factors: tests/worker/test_longrope.py.
    "phi4_mini": ("phi3", {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "factor": 4.0, "original_max_position_embeddings": 512,
                            "short_factor": [1.0, 1.3, 1.9, 2.6, 3.1, 4.0],
                            "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 13.0]},
        "original_max_position_embeddings": 512,
    }),
    "qwen2_rope_yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            }
        },
    ),
}


def make_variant(tmp_path: str | Path, name: str) -> Path:
    """The checkpoint for one of ``VARIANTS``."""
    arch, overrides = VARIANTS[name]
    return make_tiny_model(tmp_path, arch, **overrides)


SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
Paged attention stores keys and values in fixed-size blocks so memory is never wasted.
A scheduler batches many requests together and runs one forward pass for all of them.
Hello, world! How are you today? I am fine, thank you, and how is the weather there?
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 appear in text; so do symbols: + - * / = ( ) [ ] { }.
Once upon a time there was a small model that learned to write short stories about the sea.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))
The rain in Spain stays mainly in the plain. She sells sea shells by the sea shore.
{"name": "octavo", "version": 1, "tags": ["fast", "small"], "ok": true, "value": null}
"""


def make_tiny_model(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    dtype: str = "float32",
    seed: int = 0,
    generation_config: Optional[dict[str, Any]] = None,
    headless: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` checkpoint under ``tmp_path`` and return its folder.

    ``overrides`` are config.json fields (e.g. ``tie_word_embeddings=True``,
    ``rope_parameters={...}``, ``num_hidden_layers=1``); ``dtype`` is the stored
    weight dtype ("float32", "bfloat16", "float16"); ``generation_config``
    replaces the default generation_config.json fields. ``headless``: the
    decoder without its LM head (``Qwen3Model``, as ``AutoModel`` saves it: an
    embedding checkpoint).
    """
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    config_cls, model_cls, arch_defaults = _ARCHS[arch]
    fields = {**_COMMON, **arch_defaults, **overrides}
    fields.setdefault("bos_token_id", BOS_ID)
    fields.setdefault("eos_token_id", EOS_ID)
    fields.setdefault("pad_token_id", PAD_ID)
    gen = generation_config if generation_config is not None else {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
    }

    if headless:
        model_cls = model_cls.replace("ForCausalLM", "Model")
    key = json.dumps([arch, dtype, seed, gen, fields] + (["headless"] if headless else []), sort_keys=True, default=str)
    folder = Path(tmp_path) / f"{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)

    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    if arch in _RANDOM_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    if arch in _RANDOM_ROUTER_BIAS:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.3)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(folder)
    # save_pretrained writes its own generation_config.json from the config;
    # ours replaces it so tests control exactly what the engine reads.
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer(folder, vocab_size=fields["vocab_size"])
    return folder


def write_tokenizer(folder: str | Path, vocab_size: int = 512) -> None:
    """A byte-level BPE trained on a small fixed corpus, plus its config."""
    folder = Path(folder)
    size = min(vocab_size, 512)
    if size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,  # the post-processor already adds it
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def load_hf_model(folder: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers reference model for a folder written by make_tiny_model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


_ST_POOLING_KEYS = {
    "last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
}


def make_sentence_transformers_model(
    tmp_path: str | Path, pooling: str, normalize: bool = True, arch: str = "qwen3", **overrides: Any
) -> Path:
    """A headless checkpoint laid out as sentence-transformers 5 and earlier
    saved embedding models (Qwen3-Embedding is published so): modules.json,
    1_Pooling/config.json, and a Normalize module when ``normalize``."""
    base = make_tiny_model(tmp_path, arch, headless=True, **overrides)
    folder = Path(tmp_path) / f"st-{pooling}-{int(normalize)}-{base.name}"
    if (folder / "modules.json").is_file():
        return folder
    shutil.copytree(base, folder, dirs_exist_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    pooling_config = {"word_embedding_dimension": hidden, "include_prompt": True}
    pooling_config.update({key: mode == pooling for mode, key in _ST_POOLING_KEYS.items()})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    return folder


def hf_embeddings(folder: str | Path, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
    """The reference: transformers' AutoModel ``last_hidden_state`` pooled
    with torch, one prompt at a time (no padding to get wrong)."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            vectors.append(vector.tolist())
    return vectors

"""GGUF files written from tiny transformers models (as llama.cpp's converter
writes them) load as the same model: F32/BF16 files give transformers'
logits on the stored weights, Q8_0/Q4_0/Q4_1 files run on the int8/int4 kernels
within 1e-3 of transformers on the dequantized weights with identical
greedy tokens, other block types are dequantized; the tokenizer built from
the file's vocabulary gives the Hugging Face tokenizer's ids; broken or
unsupported files are errors naming the problem."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from transformers import LlamaTokenizer

from octavo import LLM, SamplingParams
from octavo.model.config import load_arch_config
from octavo.tokenizer import Tokenizer
from tests.checkpoint.conftest import (FLOAT_ATOL, PROMPT, QUANT_ATOL, TOKENIZER_CORPUS, octavo_logits,
                                       train_sentencepiece)
from tests.checkpoint.gguf_writer import rewrite_gguf, write_gguf
from tests.engine.conftest import hf_greedy
from tests.model_factory import load_hf_model, make_tiny_model
from tests.quant.q8_0_rows import round_linear_inputs
from tests.worker.runner_utils import hf_logits, make_runner

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _kernels(path) -> dict[str, str]:
    """Linear module name -> its kernel."""
    model = make_runner(path).model
    return {name: m.linear_method.kernel_name(m) for name, m in model.named_modules() if hasattr(m, "linear_method")}


@pytest.mark.parametrize("arch, matrix_type", [
    ("llama", "F32"), ("qwen2", "F32"), ("qwen3", "F16"), ("llama", "BF16"), ("qwen2", "BF16"),
])
def test_float_files_match_transformers(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    got, tokens = octavo_logits(path)
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=FLOAT_ATOL, rtol=0)


@pytest.mark.parametrize("arch, matrix_type", [
    ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("qwen3", "Q8_0"), ("llama", "Q4_0"), ("qwen2", "Q4_0"), ("qwen3", "Q4_0"),
    ("llama", "Q4_1"), ("qwen3", "Q4_1"),
])
def test_block_types_run_on_the_int_kernels(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    kernels = _kernels(path)
    # Every linear layer of the blocks runs quantized; lm_head stays float (as with --quantization).
    bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}[matrix_type]
    assert all(k.startswith(f"gguf {matrix_type} (int{bits} group 32): int{bits}")
               for name, k in kernels.items() if name != "lm_head"), kernels
    assert not kernels["lm_head"].startswith("gguf")
    got, tokens = octavo_logits(path, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("arch, matrix_type", [("llama", "Q8_0"), ("qwen3", "Q4_0"), ("llama", "Q4_1")])
def test_int8_activations_match_transformers_with_q8_0_rounded_inputs(files, arch, matrix_type):
    """A 3-token prompt and decode steps: every product has at most QDOT_ROWS rows, so every quantized layer
    rounds its rows to int8; transformers does the same rounding in a hook on each of its linear layers.
    The embedding is stored as F32: a block-quantized table holds multiples of one scale, which after the norm
    put values exactly on halves, where a last-bit difference between the two sides' norms decides the
    rounding (a step of d); tests/quant/test_qdot.py pins the rounding itself."""
    path, reference = files(arch, matrix_type, types={"model.embed_tokens.weight": "F32"})
    assert all("q8_0 rows" in k for name, k in _kernels(path).items() if name != "lm_head")
    got, tokens = octavo_logits(path, prompt=PROMPT[:3], decode=(7, 99, 5, 300))
    hf = load_hf_model(reference)
    round_linear_inputs(hf)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("arch, matrix_type", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("llama", "Q4_1"), ("llama", "F32")])
def test_greedy_tokens_match_transformers(files, arch, matrix_type):
    path, reference = files(arch, matrix_type)
    prompts = [PROMPT[:n] for n in (1, 9, 24)]
    outs = LLM(path, dtype="float32", quantized_activations="float").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=16)


def test_mistral_sliding_window_and_tied_embeddings(files):
    """A window shorter than the prompt (kept in attention.sliding_window), and no output.weight (tied)."""
    path, reference = files("mistral", "F32", tie_word_embeddings=True)
    arch = load_arch_config(path)
    assert arch.tie_word_embeddings and arch.layer_windows == (8, 8)
    got, tokens = octavo_logits(path)
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=FLOAT_ATOL, rtol=0)


def test_other_block_types_are_dequantized(files, caplog):
    """Q5_0 has no kernel; q_proj in Q8_0 beside k/v in Q4_0 cannot run as one fused layer: both dequantized."""
    mixed = {f"model.layers.{i}.self_attn.{p}.weight": t for i in range(2)
             for p, t in (("q_proj", "Q8_0"), ("k_proj", "Q4_0"), ("v_proj", "Q4_0"))}
    path, reference = files("llama", "Q5_0", types=mixed)
    with caplog.at_level(logging.INFO, logger="octavo.model.gguf.tensors"):
        kernels = _kernels(path)
    assert not any(k.startswith("gguf") for k in kernels.values()), kernels
    assert "dequantized while loading" in caplog.text and "Q5_0" in caplog.text and "Q8_0" in caplog.text
    got, tokens = octavo_logits(path)
    torch.testing.assert_close(got, hf_logits(load_hf_model(reference), tokens), atol=FLOAT_ATOL, rtol=0)


def test_config_comes_from_the_metadata(files):
    path, reference = files("qwen3", "Q8_0")
    ours, hf = load_arch_config(path), load_arch_config(reference)
    assert ours.quantization is not None and ours.quantization.method == "gguf"
    assert ours.dtype == "bfloat16"  # a quantized file's activations default to bf16
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)  # GGUF stores it as float32
    assert replace(ours, quantization=None, dtype=hf.dtype, eos_token_ids=hf.eos_token_ids[:1],
                   rms_norm_eps=hf.rms_norm_eps) == hf


def test_gpt2_vocabulary_gives_the_hf_tokenizers_ids(files):
    path, reference = files("qwen2", "F32")
    ours, hf = Tokenizer(path), Tokenizer(reference)
    for text in TOKENIZER_CORPUS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(hf.encode(text)) == hf.decode(hf.encode(text)), text
    assert (ours.bos_token_id, ours.eos_token_id, ours.chat_template) == (hf.bos_token_id, hf.eos_token_id,
                                                                            hf.chat_template)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages)


def test_llama_vocabulary_gives_transformers_ids(tmp_path):
    folder = make_tiny_model(tmp_path, "llama")
    train_sentencepiece(folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                              "eos_token": "</s>"}))
    path = write_gguf(folder, tmp_path / "spm.gguf", vocab="llama")
    ours, hf = Tokenizer(path), LlamaTokenizer.from_pretrained(folder)
    for text in TOKENIZER_CORPUS:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True), text


def test_serve_a_gguf_file(files, tmp_path):
    """`octavo serve model.gguf` end to end (~20 s: a real server process is what is tested):
    served under the file's name, chat through the template from the metadata."""
    import httpx

    from tests.server.conftest import ServerProcess

    path, _ = files("qwen2", "Q8_0")
    srv = ServerProcess(path, tmp_path / "server.log", api_key=None)
    try:
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]] == [path.name]
        body = {"model": path.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()


# ---- bad files -----------------------------------------------------------------


def test_truncated_file_is_named(files, tmp_path):
    path, _ = files("llama", "F32")
    broken = tmp_path / "broken.gguf"
    whole = path.read_bytes()
    for cut, reason in ((300, "more than its 300 bytes can hold"), (len(whole) - 64, "lies outside the file"),
                        (0, "not a readable GGUF file"), (10, "not a GGUF file")):
        broken.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"broken.gguf.*{reason}"):
            load_arch_config(broken)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    (tmp_path / "model.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="model.gguf is not a GGUF file"):
        LLM(tmp_path / "model.gguf")


def test_unsupported_architecture_is_named(files, tmp_path):
    path, _ = files("llama", "F32")
    other = rewrite_gguf(path, tmp_path / "falcon.gguf", **{"general.architecture": "falcon"})
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported; supported: deepseek2, llama"):
        LLM(other)


def test_unknown_pre_tokenizer_is_named(files, tmp_path):
    path, _ = files("llama", "F32")
    other = rewrite_gguf(path, tmp_path / "pre.gguf", **{"tokenizer.ggml.pre": "mystery-bpe"})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'mystery-bpe' is not supported"):
        Tokenizer(other)


def test_missing_metadata_is_named(files, tmp_path):
    path, _ = files("llama", "F32")
    other = rewrite_gguf(path, tmp_path / "short.gguf", drop=("llama.block_count",))
    with pytest.raises(ValueError, match="GGUF metadata has no 'llama.block_count'"):
        load_arch_config(other)


def test_quantizing_a_quantized_file_again_is_refused(files):
    path, _ = files("qwen2", "Q8_0")
    with pytest.raises(ValueError, match=r"already quantized \(gguf, as its config.json or GGUF file says\)"):
        make_runner(path, quantization="int8")

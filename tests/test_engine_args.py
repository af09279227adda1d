"""One configuration path: the command line, LLM(...) and the server build the
same EngineConfig from the same names (the fields of octavo/config.py)."""
from __future__ import annotations

import pytest

from octavo.assets import MINI_DRAFT_MODEL_PATH
from octavo.config import EngineConfig, ModelConfig
from octavo.entrypoints.cli import build_parser, main
from octavo.entrypoints.engine_args import config_fields, engine_config, engine_config_from_args

# A value other than the default for each field, written as on the command line.
_NON_DEFAULT = {
    "tokenizer": ("tok-folder", "tok-folder"),
    "dtype": ("bfloat16", "bfloat16"),
    "max_model_len": ("77", 77),
    "seed": ("5", 5),
    "max_logprobs": ("3", 3),
    "device": ("cuda", "cuda"),
    "served_model_name": ("my-model", ("my-model",)),
    "generation_config": ("vllm", "vllm"),
    "attention_backend": ("torch", "torch"),
    "sparse_attention": ("quest", "quest"),
    "sparse_top_pages": ("8", 8),
    "sparse_recent_pages": ("3", 3),
    "linear_backend": ("onednn", "onednn"),
    "quantization": ("int4", "int4"),
    "quantization_group_size": ("64", 64),
    "quantized_activations": ("float", "float"),
    "unquantized_modules": ("lm_head,model.layers.0.*", "lm_head,model.layers.0.*"),
    "lm_head_quantization": ("none", "none"),
    "task": ("embed", "embed"),
    "pooling_type": ("weightedmean", "weightedmean"),
    "block_size": ("32", 32),
    "kv_cache_memory_bytes": ("3MiB", 3 * 2**20),
    "memory_fraction": ("0.5", 0.5),
    "num_blocks": ("9", 9),
    "cache_dtype": ("float32", "float32"),
    "kv_cache_dtype": ("int8", "int8"),
    "kv_events_endpoint": ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
    "kv_offload_host_bytes": ("4GiB", 4 * 2**30),
    "kv_offload_dir": ("kv-blocks", "kv-blocks"),
    "step_record": ("steps.jsonl", "steps.jsonl"),
    "kv_offload_disk_bytes": ("100G", 100 * 10**9),
    "max_num_seqs": ("3", 3),
    "max_num_batched_tokens": ("99", 99),
    "tensor_parallel_size": ("2", 2),
    "pipeline_parallel_size": ("2", 2),
    "distributed_executor_backend": ("ray", "ray"),
    "threads_per_worker": ("3", 3),
    "speculative_method": ("ngram", "ngram"),
    # The shipped draft's name stands for its folder.
    "speculative_model": ("octavo-mini-draft", str(MINI_DRAFT_MODEL_PATH)),
    "num_speculative_tokens": ("3", 3),
    "ngram_min": ("2", 2),
    "ngram_max": ("6", 6),
    "speculative_max_batch_size": ("8", 8),
    "speculative_draft_vocab": ("512", 512),
}


def _fields() -> list:
    return [cf for cf in config_fields() if cf.name != "model"]


def test_field_names_are_unique_across_sections():
    names = [cf.name for cf in config_fields()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_config_field_is_a_cli_option_and_an_llm_keyword(command, tmp_path):
    """Each field set from the command line (as --field-name) and as a keyword
    gives the same EngineConfig, with the value in that field."""
    extra = ["--prompt", "x"] if command == "generate" else []
    for cf in _fields():
        if cf.type is bool:
            # Flipped from the default; a switch left unset by default (None: decided later) is turned on.
            value = not cf.field.default
            cli_args = [cf.flag if value else f"--no-{cf.flag[2:]}"]
        else:
            assert cf.name in _NON_DEFAULT, f"add a test value for the new field {cf.name}"
            text, value = _NON_DEFAULT[cf.name]
            cli_args = [cf.flag, text]
        args = build_parser().parse_args([command, str(tmp_path), *cli_args, *extra])
        from_cli = engine_config_from_args(args)
        from_kwargs = engine_config(tmp_path, **{cf.name: value})
        assert from_cli == from_kwargs, cf.name
        assert getattr(getattr(from_cli, cf.section), cf.name) == value, cf.name
        assert from_cli != engine_config(tmp_path), f"{cf.flag} changed nothing"


def test_options_left_out_take_the_dataclass_defaults(tmp_path):
    args = build_parser().parse_args(["serve", str(tmp_path)])
    assert engine_config_from_args(args) == EngineConfig(model=ModelConfig(model=str(tmp_path)))


def test_older_spellings_still_work(tmp_path):
    args = build_parser().parse_args(
        ["serve", str(tmp_path), "--kv-cache-memory", "2GiB", "--no-prefix-caching", "--no-fused-ops"]
    )
    config = engine_config_from_args(args)
    assert config.cache.kv_cache_memory_bytes == 2 * 2**30
    assert not config.cache.enable_prefix_caching and not config.model.fused_ops


def test_vllm_spellings_and_units(tmp_path):
    """vLLM's flag names where the meaning is the same, its token-count suffixes and dtype names."""
    args = build_parser().parse_args([
        "serve", str(tmp_path), "--gpu-memory-utilization", "0.5", "--enable-prefix-caching", "--max-model-len", "4k",
        "--max-num-batched-tokens", "2K", "--dtype", "half", "--served-model-name", "a", "b",
    ])
    config = engine_config_from_args(args)
    assert config.cache.memory_fraction == 0.5 and config.cache.enable_prefix_caching
    assert config.model.max_model_len == 4000 and config.scheduler.max_num_batched_tokens == 2048
    assert config.model.dtype == "half" and config.model.served_model_name == ("a", "b")
    assert engine_config(tmp_path, served_model_name="a").model.served_model_name == ("a",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(tmp_path), "--max-model-len", "4.5"])


def test_unknown_or_invalid_keywords_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="'swap_space_bytes'"):
        engine_config(tmp_path, swap_space_bytes=0)  # removed: no swap tier uses it
    with pytest.raises(ValueError, match="block_size"):
        engine_config(tmp_path, block_size=0)


def test_the_llm_api_refuses_an_unknown_keyword(tmp_path):
    from octavo.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="'max_waiting_requests'"):
        LLM(tmp_path, max_waiting_requests=4)  # a server option, not an engine one


def test_generate_options_reach_the_engine(tmp_path, monkeypatch, capsys):
    """`octavo generate --attention-backend torch ...` builds its engine with them
    (they used to be accepted and dropped)."""
    import octavo.entrypoints.llm as llm_module
    from tests.model_factory import make_tiny_model

    engines = []

    class Recording(llm_module.LLMEngine):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config)
            engines.append(self)

    monkeypatch.setattr(llm_module, "LLMEngine", Recording)
    folder = make_tiny_model(tmp_path, "llama")
    main(["generate", str(folder), "--dtype", "float32", "--num-blocks", "32", "--attention-backend", "torch",
          "--linear-backend", "torch", "--no-fused-ops", "--max-num-seqs", "3", "--prompt", "Hi", "--max-tokens", "2"])
    assert "### Hi" in capsys.readouterr().out
    (engine,) = engines
    assert engine.config == engine_config(
        folder, dtype="float32", num_blocks=32, attention_backend="torch", linear_backend="torch",
        fused_ops=False, max_num_seqs=3,
    )
    runner = engine.executor.worker.runner  # the default in-process executor
    assert runner.backends.attention.name == "torch"
    assert runner.backends.ops.name == "torch"
    assert engine.scheduler.config.max_num_seqs == 3


def test_serve_help_lists_every_engine_option(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for cf in _fields():
        assert cf.flag in text, cf.flag


def test_a_missing_draft_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="speculative_model folder not found"):
        engine_config(tmp_path, speculative_model=str(tmp_path / "no-such-draft"))


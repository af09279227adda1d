"""The `octavo` command line: offline generation and argument errors."""
from __future__ import annotations

import pytest

from octavo import SamplingParams
from octavo.entrypoints.cli import main


def test_generate_prints_greedy_text(model_path, offline_llm, capsys):
    main(["generate", str(model_path), "--dtype", "float32", "--num-blocks", "64",
          "--prompt", "Hello there", "--prompt", "The rain", "--max-tokens", "6", "--temperature", "0"])
    printed = capsys.readouterr().out
    refs = offline_llm.generate(["Hello there", "The rain"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    expected = "".join(f"### {p}\n{r.outputs[0].text}\n\n" for p, r in zip(["Hello there", "The rain"], refs))
    assert printed == expected


def test_generate_takes_unset_sampling_options_from_generation_config(tmp_path, capsys):
    from tests.model_factory import make_tiny_model

    # The model asks for greedy decoding in generation_config.json; the
    # command line leaves temperature unset, so the output is greedy.
    folder = make_tiny_model(tmp_path, "llama", generation_config={"eos_token_id": [1, 4], "temperature": 0.0})
    args = ["generate", str(folder), "--dtype", "float32", "--num-blocks", "64", "--prompt", "Hello", "--max-tokens", "8"]
    main(args)
    first = capsys.readouterr().out
    main(args + ["--seed", "7"])  # another seed: still the same text, as greedy must be
    assert capsys.readouterr().out == first
    main(args + ["--temperature", "0"])
    assert capsys.readouterr().out == first


def test_generate_length_defaults_to_max_new_tokens(tmp_path, capsys):
    from tests.model_factory import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", generation_config={"max_new_tokens": 3, "temperature": 0.0})
    args = ["generate", str(folder), "--dtype", "float32", "--num-blocks", "64", "--prompt", "Hello"]
    main(args)
    unset = capsys.readouterr().out
    main(args + ["--max-tokens", "3"])
    assert capsys.readouterr().out == unset
    main(args + ["--max-tokens", "64"])  # the built-in default when the file has none
    assert capsys.readouterr().out != unset


def test_bad_arguments_exit_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "model folder not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path), "--kv-cache-memory", "lots"])
    assert exc.value.code == 2 and "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path), "--port", "70000"])
    assert exc.value.code == 2 and "port must be in" in capsys.readouterr().err
    for command in ("serve", "generate"):  # both build the same ParallelConfig
        with pytest.raises(SystemExit) as exc:
            main([command, str(tmp_path), "--tensor-parallel-size", "0", *(["--prompt", "x"] * (command == "generate"))])
        assert exc.value.code == 2 and "tensor_parallel_size must be" in capsys.readouterr().err


def test_no_model_means_the_default_one(smollm2, monkeypatch):
    from octavo.entrypoints.cli import build_parser
    from octavo.entrypoints.engine_args import engine_config_from_args

    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(smollm2.parents[2]))
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--no-prefix-caching"])
    config = engine_config_from_args(args)
    assert config.model.model == str(smollm2) and config.model.served_model_name == ("smollm2-135m-instruct",)
    assert config.cache.kv_cache_memory_bytes == 2 * 2**30 and not config.cache.enable_prefix_caching


@pytest.mark.parametrize("args,words", [
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no such file"),
    (["--enable-auto-tool-choice"], "needs a tool_call_parser"),
])
def test_serve_refuses_bad_tool_and_template_options_in_one_line(model_path, capsys, args, words):
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(model_path), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_chat_template_option_takes_a_file_or_the_text(tmp_path):
    from octavo.entrypoints.cli import _chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert _chat_template(str(path)) == "{{ messages[0].content }}"
    assert _chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")


def test_models_own_broken_template_fails_before_the_engine_starts(tmp_path):
    import json

    from octavo.config import EngineConfig, ModelConfig
    from octavo.server.app import load_tokenizer
    from octavo.server.config import ServerConfig
    from tests.model_factory import write_tokenizer

    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"  # unclosed tag
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the model's chat template: chat template is not valid Jinja"):
        load_tokenizer(EngineConfig(model=ModelConfig(model=str(tmp_path))), ServerConfig())
    # --chat-template replaces it, and then the server starts.
    fixed = ServerConfig(chat_template="{{ messages[0].content }}")
    assert load_tokenizer(EngineConfig(model=ModelConfig(model=str(tmp_path))), fixed).chat_template == fixed.chat_template


def test_generate_passes_the_kernel_switches_to_the_engine(model_path, monkeypatch, capsys):
    """`octavo generate` builds its engine from the same generated options as `serve`."""
    import octavo.entrypoints.llm as llm_module

    seen = {}

    class Recorder(llm_module.LLM):
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(llm_module, "LLM", Recorder)
    main(["generate", str(model_path), "--dtype", "float32", "--num-blocks", "32", "--prompt", "Hi", "--max-tokens", "2",
          "--attention-backend", "torch", "--linear-backend", "torch", "--no-fused-ops"])
    assert seen["attention_backend"] == "torch" and seen["linear_backend"] == "torch" and seen["fused_ops"] is False
    assert capsys.readouterr().out.startswith("### Hi\n")


def test_generate_prints_text_as_it_is_produced(model_path, offline_llm, monkeypatch):
    """Each pull from the engine's stream finds the text so far already on stdout,
    the prompt printed now growing token by token; the whole is the batch's output."""
    import io

    from octavo.entrypoints import cli

    prompts = ["Hello there", "The rain"]
    params = SamplingParams(temperature=0, max_tokens=6)
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    seen: list[str] = []

    def watched():
        for item in offline_llm.stream(prompts, params):
            seen.append(out.getvalue())
            yield item

    cli._print_streams(prompts, watched())
    refs = offline_llm.generate(prompts, params, use_tqdm=False)
    first = refs[0].outputs[0].text
    assert out.getvalue() == "".join(f"### {p}\n{r.outputs[0].text}\n\n" for p, r in zip(prompts, refs))
    # While generating, the first prompt's partial text was on stdout: at least
    # one snapshot strictly between the bare header and the finished block.
    header, block = "### Hello there\n", f"### Hello there\n{first}"
    partial = [s for s in seen if len(header) < len(s) < len(block) and block.startswith(s)]
    assert partial, seen


def test_generate_output_to_a_pipe_is_plain_text(model_path, offline_llm):
    """Through a pipe (not a terminal): the blocks only, no progress bar or control characters."""
    import os
    import subprocess
    import sys

    from tests.server.conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli", "generate", str(model_path), "--dtype", "float32",
         "--num-blocks", "64", "--prompt", "Hello", "--prompt", "Hi", "--max-tokens", "4", "--temperature", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    refs = offline_llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert proc.stdout == "".join(f"### {p}\n{r.outputs[0].text}\n\n" for p, r in zip(["Hello", "Hi"], refs))
    assert not any(c in proc.stdout + proc.stderr for c in "\r\x1b")


def test_a_port_in_use_is_one_line_before_the_model_loads(model_path, capsys, monkeypatch):
    import socket

    import octavo.server.launcher

    def no_loading(*args, **kwargs):
        raise AssertionError("the app was built although the port is taken")

    monkeypatch.setattr(octavo.server.launcher, "build_app", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(model_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_options_are_never_abbreviated_and_typos_get_the_closest_name(tmp_path, capsys):
    from octavo.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", str(tmp_path), "--max-num-seq", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "octavo serve: error: unrecognized arguments: --max-num-seq" in err
    assert "did you mean --max-num-seqs?" in err and err.startswith("usage: octavo serve")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "run", "--cost-model", "c.json", "--durat", "5"])
    assert "octavo simulate run: error:" in capsys.readouterr().err


def test_model_is_also_taken_as_an_option(tmp_path, capsys):
    from octavo.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--model", str(tmp_path)]).model == str(tmp_path)
    assert build_parser().parse_args(["generate", str(tmp_path), "--prompt", "x"]).model == str(tmp_path)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "a", "--model", "b"])
    assert "give the model once" in capsys.readouterr().err


def test_llm_keyword_typos_get_the_closest_name():
    from octavo import LLM

    with pytest.raises(ValueError, match="unknown engine option 'max_num_seq' \\(did you mean 'max_num_seqs'"):
        LLM("octavo-mini", max_num_seq=4)


@pytest.mark.parametrize("broken, words", [
    ("safetensors", "model.safetensors is not a readable safetensors file"),
    ("config", "no config.json in"),
    ("folder", "nor a config.json: not a Hugging Face checkpoint folder"),
    ("gguf", "model.gguf is not a readable GGUF file"),
])
def test_start_up_failures_are_one_error_line_naming_the_file(tmp_path, broken, words):
    import shutil
    import subprocess
    import sys

    from octavo.assets import MINI_MODEL_PATH
    from tests.server.conftest import REPO, free_port

    model = tmp_path / "model"
    if broken == "gguf":
        model = tmp_path / "model.gguf"
        model.write_bytes(b"")
    elif broken == "folder":
        model.mkdir()
    else:
        shutil.copytree(MINI_MODEL_PATH, model)
        if broken == "safetensors":
            (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:100])
        else:
            (model / "config.json").unlink()
    result = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(model), "--port",
                             str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0].startswith("octavo: error: ") and words in errors[0]

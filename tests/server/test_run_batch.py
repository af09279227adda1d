"""`octavo run-batch`: OpenAI batch files answered exactly as `octavo serve` answers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from octavo.entrypoints.cli import main
from octavo.entrypoints.run_batch import BATCH_URLS, parse_line
from tests.server.conftest import REPO

_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
_COMPLETION = {"model": "tiny", "prompt": "The rain", "max_tokens": 5, "temperature": 0, "logprobs": 2}
# Over a limit the server checks (--max-n): a 400 from the server, not a bad line.
_REFUSED = {"model": "tiny", "prompt": "x", "n": 1000}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _stable(body: dict) -> dict:
    """A response body less what differs between any two calls (its id and creation time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.fixture(scope="module")
def batch_results(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    lines = [
        _line("chat-1", "/v1/chat/completions", _CHAT),
        _line("cmpl-1", "/v1/completions", _COMPLETION),
        "{not json",
        _line("refused", "/v1/completions", _REFUSED),
        json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/images", "body": {}}),
        "",  # blank lines are skipped
        _line("chat-2", "/v1/chat/completions", {**_CHAT, "max_tokens": 3}),
    ]
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    main(["run-batch", str(model_path), "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
          "--dtype", "float32", "--num-blocks", "256", "--served-model-name", "tiny"])
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def test_every_line_gets_a_result_in_input_order(batch_results):
    assert [r["custom_id"] for r in batch_results] == ["chat-1", "cmpl-1", None, "refused", "wrong-url", "chat-2"]
    assert len({r["id"] for r in batch_results}) == len(batch_results)
    ok = [r for r in batch_results if r["error"] is None]
    assert [r["custom_id"] for r in ok] == ["chat-1", "cmpl-1", "refused", "chat-2"]
    for r in ok:
        assert r["response"]["request_id"]
        assert r["response"]["status_code"] == (400 if r["custom_id"] == "refused" else 200)


def test_a_bad_line_gets_an_error_and_the_rest_run(batch_results):
    by_id = {r["custom_id"]: r for r in batch_results}
    assert "not valid JSON" in batch_results[2]["error"]["message"] and batch_results[2]["response"] is None
    assert "url must be one of" in by_id["wrong-url"]["error"]["message"]
    refused = by_id["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "n"
    assert by_id["chat-2"]["response"]["status_code"] == 200
    assert by_id["chat-2"]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_bodies_equal_what_the_server_returns(batch_results, server):
    by_id = {r["custom_id"]: r["response"] for r in batch_results}
    with server.http() as http:
        for custom_id, url, body in (("chat-1", "/v1/chat/completions", _CHAT),
                                     ("cmpl-1", "/v1/completions", _COMPLETION),
                                     ("refused", "/v1/completions", _REFUSED)):
            live = http.post(url, json=body)
            assert by_id[custom_id]["status_code"] == live.status_code
            expected = live.json()
            got = by_id[custom_id]["body"]
            if live.status_code == 200:
                expected, got = _stable(expected), _stable(got)
                assert got["choices"][0]["finish_reason"] == "length"  # the model generated, as asked
            else:  # error messages carry no request-specific id here
                assert "request id" not in expected["error"]["message"]
            _assert_same(got, expected)


def _assert_same(got, expected, path="body"):
    """Equal, except that logprobs may differ in the last float32 digits: the
    batch ran its requests together, the server one at a time."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-4), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), path
        for key in expected:
            _assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_same(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


def test_stdin_and_stdout(model_path):
    """`-i -` / `-o -`: a pipe in, results out; the progress bar goes to stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli", "run-batch", str(model_path), "-i", "-", "-o", "-",
         "--dtype", "float32", "--num-blocks", "64"],
        input=_line("only", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}) + "\n",
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    (result,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert result["custom_id"] == "only" and result["response"]["status_code"] == 200
    assert result["response"]["body"]["usage"]["completion_tokens"] == 2
    # The progress bar: requests done and the engine's generated tokens per second.
    bar = proc.stderr.replace("\r", "\n").splitlines()
    assert any("run-batch: 100%" in line and "1/1" in line and "2 tokens" in line and "tok/s" in line
               for line in bar), proc.stderr[-2000:]


@pytest.mark.parametrize("text, message", [
    ('{"method": "POST", "url": "/v1/completions", "body": {}}', "custom_id must be a string"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "method must be POST"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": []}', "body must be a JSON object"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"stream": true}}', "stream is not supported"),
    ('[1, 2]', "expected a JSON object"),
])
def test_parse_line_names_what_is_wrong(text, message):
    req = parse_line(text, 7, BATCH_URLS[:2])
    assert req.error.startswith("line 7: ") and message in req.error and req.body is None


def test_a_model_that_cannot_load_is_one_line(model_path, tmp_path, capsys):
    import shutil

    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, folder / name)
    (tmp_path / "in.jsonl").write_text(_line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1}) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["run-batch", str(folder), "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "octavo: error: start-up failed:" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()

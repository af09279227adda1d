"""`octavo run-batch`: OpenAI batch files answered exactly as `octavo serve` answers;
bad lines, engine deaths and timeouts cost only what they must."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from octavo.engine.fault_injection import ENV as STEP_DELAY_ENV
from octavo.entrypoints.cli import main
from octavo.entrypoints.run_batch import BATCH_URLS, parse_line
from tests.server.conftest import REPO
from tests.server.helpers import wait_for

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
        # A line separator inside a JSON string is text, not the end of the line.
        json.dumps({"custom_id": "u2028", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "a\u2028b", "max_tokens": 2}}, ensure_ascii=False),
        '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ]
    data = "\n".join(lines).encode() + b"\n" + b'{"custom_id": "bad-utf8 \xff"}\n'
    data += (_line("last", "/v1/completions", {"prompt": "x", "max_tokens": 1}) + "\n").encode()
    (folder / "in.jsonl").write_bytes(data)
    main(["run-batch", str(model_path), "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
          "--dtype", "float32", "--num-blocks", "256", "--served-model-name", "tiny"])
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def _error_line(results: list[dict], words: str) -> dict:
    (found,) = [r for r in results if r["error"] is not None and words in r["error"]["message"]]
    return found


def test_every_line_gets_one_result(batch_results):
    """Written as each finishes: one per line, matched by custom_id."""
    ok = ["chat-1", "chat-2", "cmpl-1", "last", "refused", "u2028"]
    assert sorted(r["custom_id"] for r in batch_results if r["custom_id"]) == sorted([*ok, "wrong-url"])
    assert len(batch_results) == 10 and len({r["id"] for r in batch_results}) == len(batch_results)
    answered = [r for r in batch_results if r["error"] is None]
    assert sorted(r["custom_id"] for r in answered) == ok
    for r in answered:
        assert r["response"]["request_id"]
        assert r["response"]["status_code"] == (400 if r["custom_id"] == "refused" else 200)


def test_a_bad_line_gets_an_error_and_the_rest_run(batch_results):
    by_id = {r["custom_id"]: r for r in batch_results}
    assert _error_line(batch_results, "not valid JSON: Expecting")["response"] is None
    assert "url must be one of" in by_id["wrong-url"]["error"]["message"]
    refused = by_id["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "n"
    assert by_id["chat-2"]["response"]["status_code"] == 200
    assert by_id["chat-2"]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_odd_lines_are_their_own_errors(batch_results):
    """A U+2028 in a string does not split its line; a line of invalid UTF-8
    or nested 100 000 deep is that line's error, and the lines after it run."""
    by_id = {r["custom_id"]: r for r in batch_results}
    assert by_id["u2028"]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert _error_line(batch_results, "nested too deeply")["error"]["message"].startswith("line 9: ")
    assert _error_line(batch_results, "not valid UTF-8")["error"]["message"].startswith("line 10: ")
    assert by_id["last"]["response"]["status_code"] == 200


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
    req = parse_line(text.encode(), 7, BATCH_URLS[:2])
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


def _batch(model_path: Path, folder: Path, lines: list[str], *args: str, delay: str = "") -> subprocess.Popen:
    """`octavo run-batch` in a process of its own; steps sleep ``delay`` seconds while it is set."""
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    step_delay = folder / "step-delay"
    if delay:
        step_delay.write_text(delay)
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli", "run-batch", str(model_path), "-i",
           str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"), "--dtype", "float32", "--num-blocks", "128",
           "--enforce-eager", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", STEP_DELAY_ENV: str(step_delay)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _results(folder: Path) -> list[dict]:
    path = folder / "out.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _engine_of(proc: subprocess.Popen) -> int:
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError("no engine child process")


def test_an_engine_death_retries_the_lines_in_flight(model_path, tmp_path):
    """Lines are written as they finish (a crash loses none of them); the
    lines the killed engine held run again on the next one."""
    lines = [_line(f"r{i}", "/v1/completions", {"prompt": f"line {i}", "max_tokens": 8, "ignore_eos": True})
             for i in range(6)]
    proc = _batch(model_path, tmp_path, lines, "--max-num-seqs", "2", delay="0.3")
    try:
        wait_for(lambda: len(_results(tmp_path)) >= 1, timeout_s=180, what="a first result line")
        assert proc.poll() is None  # written while the batch still runs
        os.kill(_engine_of(proc), signal.SIGKILL)
        time.sleep(1.0)
        (tmp_path / "step-delay").unlink()
        assert proc.wait(180) == 0, proc.stderr.read()
    finally:
        proc.kill()
    results = _results(tmp_path)
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 for r in results), results
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 8 for r in results)


def test_lines_failed_by_the_engine_make_the_command_fail(model_path, tmp_path):
    """No restart allowed and every step hangs: each line is marked with the
    503 that failed it, and the command exits non-zero saying how many."""
    lines = [_line(f"r{i}", "/v1/completions", {"prompt": f"line {i}", "max_tokens": 4}) for i in range(3)]
    proc = _batch(model_path, tmp_path, lines, "--engine-max-restarts", "0", "--engine-step-timeout", "2",
                  delay="3600")
    try:
        assert proc.wait(180) == 1
    finally:
        proc.kill()
    assert "3 of 3 requests failed on the server's side" in proc.stderr.read()
    results = _results(tmp_path)
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1", "r2"]
    codes = {r["response"]["body"]["error"]["code"] for r in results}
    assert all(r["response"]["status_code"] == 503 for r in results) and "engine_hung" in codes, results


def test_request_timeout_does_not_count_time_queued(model_path, tmp_path):
    """12 lines of 6 steps of at least 0.1 s each, 2 at a time, under a 2.5 s timeout: the last ones finish at
    least 3.6 s after they were queued, yet none times out (each runs for about 0.6 s)."""
    lines = [_line(f"r{i}", "/v1/completions", {"prompt": f"line {i}", "max_tokens": 6, "ignore_eos": True})
             for i in range(12)]
    proc = _batch(model_path, tmp_path, lines, "--max-num-seqs", "2", "--request-timeout", "2.5", delay="0.1")
    try:
        assert proc.wait(300) == 0, proc.stderr.read()
    finally:
        proc.kill()
    results = _results(tmp_path)
    assert len(results) == 12 and all(r["response"]["status_code"] == 200 for r in results), results

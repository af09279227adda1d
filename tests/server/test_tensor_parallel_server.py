"""`octavo serve --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`): the openai client gets the tokens
of the single-process engine; a killed rank takes the engine down with an
error naming it, and the server's supervision brings up a new one."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from octavo import SamplingParams
from tests.server.conftest import ServerProcess, stop_all, wait_all_healthy
from tests.server.helpers import wait_for

PROMPTS = ["Hello, world", "The quick brown fox jumps", "1 2 3"]


def _rank_pids(srv: ServerProcess) -> list[int]:
    """The worker processes of the server's engine, rank order."""
    engine = srv.engine_pid()
    ranks = {}
    for task in Path(f"/proc/{engine}/task").iterdir():
        for pid in (task / "children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"octavo.executor.worker_proc" in argv:
                ranks[int(argv[argv.index(b"octavo.executor.worker_proc") + 1])] = int(pid)
    return [ranks[r] for r in sorted(ranks)]


@pytest.fixture(scope="module")
def parallel(model_path, tmp_path_factory) -> dict[str, ServerProcess]:
    """The TP=2 and the PP=2 server, started side by side: each is a front, an engine and two rank processes,
    seconds of imports and loading."""
    logs = tmp_path_factory.mktemp("parallel")
    args = ("--num-blocks", "64", "--threads-per-worker", "1")
    servers = wait_all_healthy([
        ServerProcess(model_path, logs / "tp2.log", *args, "--tensor-parallel-size", "2", wait=False),
        ServerProcess(model_path, logs / "pp2.log", *args, "--pipeline-parallel-size", "2", wait=False),
    ])
    yield dict(zip(("tp2", "pp2"), servers))
    stop_all(servers)


def test_tp2_server_matches_tp1_and_survives_a_killed_rank(offline_llm, parallel):
    want = [
        o.outputs[0].text
        for o in offline_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ]
    srv = parallel["tp2"]
    client = srv.openai()
    for prompt, text in zip(PROMPTS, want):
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=16,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == text
    assert len(_rank_pids(srv)) == 2

    os.kill(_rank_pids(srv)[1], signal.SIGKILL)
    start = time.monotonic()
    # The next step notices: the engine fails naming the rank, /health turns 503.
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=srv.headers,
                   timeout=60)
    assert r.status_code in (500, 503), r.text
    assert time.monotonic() - start < 30
    wait_for(lambda: "worker rank 1" in srv.log(), what="the engine's error naming rank 1")
    srv.wait_healthy(timeout_s=120)  # restarted, with two new ranks
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=16,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[0]


def test_pp2_server_matches_tp1(offline_llm, parallel):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    client = parallel["pp2"].openai()
    model = client.models.list().data[0].id
    for prompt, text in zip(PROMPTS, want):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == text

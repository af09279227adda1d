"""Acceptance: guidellm's benchmark (``guidellm run``) against a live ``octavo serve``,
offline: synthetic prompts, the tokenizer from the local model folder, no hub."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.server.conftest import API_KEY

NUM_REQUESTS = 6


def test_guidellm_benchmark_completes_every_request(server, model_path, tmp_path):
    # One request first: a fresh machine builds the native kernels on the
    # first forward (seconds), which is not what the benchmark is about.
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2}).status_code == 200
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        # guidellm writes a log file and results into the working directory by default.
        "GUIDELLM__LOGGING__LOG_FILE": str(tmp_path / "guidellm.log"),
        "GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp_path),
        # One worker process (it runs both streams): each spawned worker imports torch again.
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "guidellm", "run",
         "--backend", f"kind=openai_http,target={server.url},model=tiny,api_key={API_KEY}",
         "--profile", "kind=concurrent,streams=2",
         "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
         # The processor that sizes the synthetic prompts: the served model's own tokenizer, from its folder.
         "--tokenizer", f"kind=huggingface_auto,model={model_path}",
         "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
         "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert state["successful_requests"] == NUM_REQUESTS, state
    assert state["errored_requests"] == 0 and state["cancelled_requests"] == 0
    done = benchmark["requests"]["successful"]
    assert len(done) == NUM_REQUESTS
    # Every request generated the tokens asked for (ignore_eos), as counted by the server's usage.
    assert all(r["output_metrics"]["text_tokens"] == 8 for r in done), [r["output_metrics"] for r in done]

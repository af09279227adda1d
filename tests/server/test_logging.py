"""`octavo serve`'s output: the engine process's log lines reach it, and a failed start is one line."""
from __future__ import annotations

import shutil

from tests.server.conftest import ServerProcess


def test_engine_process_logs_reach_the_server_output(model_path, tmp_path):
    srv = ServerProcess(model_path, tmp_path / "info.log", "--num-blocks", "32", "--log-level", "info", api_key=None)
    try:
        log = srv.log()
    finally:
        srv.stop()
    # The KV cache sizing is logged by the worker inside the spawned engine process.
    assert "KV cache: 32 blocks" in log and "octavo-engine" in log


def test_a_failed_start_is_one_line(model_path, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    # Both started at once: each start is seconds of imports and loading before it fails.
    starts = {level: ServerProcess(broken, tmp_path / f"{level}.log", "--log-level", level, api_key=None, wait=False)
              for level in ("warning", "debug")}
    for level, traceback in (("warning", False), ("debug", True)):
        srv = starts[level]
        assert srv.proc.wait(timeout=180) != 0
        log = srv.log()
        srv.stop()
        failure = [line for line in log.splitlines() if line.startswith(("octavo: error", "ERROR")) or " ERROR " in line]
        assert len(failure) == 1 and failure[0].startswith("octavo: error: "), log
        assert f"{broken / 'model.safetensors'} is not a readable safetensors file" in failure[0]
        # The traceback is there for whoever asks for debug output, and only then.
        assert ("Traceback" in log) == traceback, log

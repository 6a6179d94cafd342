"""The API key never lands in a file or a command line: given by --api-key-file or the
environment, it is in no file under the runtime directory, no process's /proc/PID/cmdline and
no child's environment, and requests need it. A key file that cannot serve exits 2 with one
line; a key others can see is warned about."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import Server, child_pids, launch

KEY = "sk-" + secrets.token_hex(16)
SERVING = "cpud.supervisor INFO ready in"  # every rank ready, HTTP serving


@pytest.fixture
def parent():
    # Short: IPC socket paths under it must stay below the 107-byte limit of AF_UNIX.
    path = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_ready(server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while SERVING not in server.log():
        assert server.proc.poll() is None, f"exited {server.proc.returncode}:\n{server.log()}"
        assert time.monotonic() < deadline, f"not ready:\n{server.log()}"
        time.sleep(0.05)


def serve_exits(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize("source", ["file", "env"])
def test_key_is_in_no_file_command_line_or_child_environment(
    model_factory, tmp_path, parent, source
):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    extra = ("--api-key-file", str(key_file)) if source == "file" else ()
    env = {"RUNTIME_DIRECTORY": str(parent), "XDG_RUNTIME_DIR": str(parent)}
    if source == "env":
        env["CPUD_API_KEY"] = KEY
    server = launch(
        model_factory("qwen3"), tmp_path / "serve.log", "--max-model-len", "256", *extra, env=env
    )
    try:
        wait_ready(server)
        children = child_pids(server.proc.pid)
        assert len(children) == 2, children  # the frontend and one rank
        files = [path for path in parent.rglob("*") if path.is_file()]
        assert any(path.name == "frontend.json" for path in files), files
        for path in files:
            assert KEY.encode() not in path.read_bytes(), path
        for pid in (server.proc.pid, *children):
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        for pid in children:
            assert KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
        assert KEY not in server.log()
        url = server.base_url + "/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("content", [None, "", "\n"], ids=["missing", "empty", "newline"])
def test_unusable_key_file_exits_2_with_one_line(tmp_path, content):
    key_file = tmp_path / "api-key"
    if content is not None:
        key_file.write_text(content)
    result = serve_exits("--api-key-file", str(key_file))
    assert result.returncode == 2, result
    assert result.stderr.startswith(f"cpud: error: --api-key-file {key_file}"), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_key_others_can_see_is_warned_about(tmp_path):
    unresolvable = ("--host", "256.0.0.1")  # stops right after the key is read: exit 2
    result = serve_exits("--api-key", KEY, *unresolvable)
    assert result.returncode == 2
    assert "warning: --api-key shows the key to every user" in result.stderr
    assert "--api-key-file" in result.stderr
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    key_file.chmod(0o644)
    result = serve_exits("--api-key-file", str(key_file), *unresolvable)
    assert result.returncode == 2
    assert f"{key_file} is readable by every user (mode 0644)" in result.stderr
    result = serve_exits("--api-key", KEY, "--api-key-file", str(key_file))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "cpud: error: --api-key and --api-key-file both give the API key: give one"
    ]

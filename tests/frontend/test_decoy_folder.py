"""`cpud serve` started from a folder that holds a folder named `cpud` (the parent of a clone):
the frontend and the ranks still import the installed package, and the daemon serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from cpud_server_helpers import Server, free_port, wait_healthy


def test_serve_from_a_folder_holding_a_cpud_folder(model_factory, tmp_path):
    decoy = tmp_path / "cpud"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy cpud was imported')\n")
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [str(Path(sys.executable).parent / "cpud"), "serve", "--model"]
    command += [str(model_factory("qwen3")), "--port", str(port), "--served-model-name", "tiny"]
    command += ["--dtype", "float32", "--tp", "2", "--collective", "shm", "--weight-cache", "off"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(server)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert server.stop() == 0, server.log()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "decoy" not in server.log()

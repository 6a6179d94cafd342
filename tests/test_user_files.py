"""Files the user names (--api-key-file, --chat-template, the model's files) that are FIFOs,
devices or too long: `cpud serve` exits 2 at once with one line naming the file, never waits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpud.process.user_files import check_model_files_are_regular, open_regular, read_text
from cpud.settings.errors import ConfigError
from cpud.text.chat_template import load_chat_template


def serve_exits(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=15,
    )
    return result, time.monotonic() - started


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_an_api_key_fifo_without_a_writer_exits_2_at_once(fifo):
    result, seconds = serve_exits("--api-key-file", str(fifo))
    assert result.returncode == 2, result
    assert result.stderr == (
        f"cpud: error: --api-key-file {fifo} is a FIFO (named pipe), not a regular file: "
        "give the path of a file\n"
    )
    assert seconds < 5  # the interpreter's start; the read itself never waits


def test_a_chat_template_fifo_exits_2_at_once(fifo, model_factory):
    result, seconds = serve_exits(
        "--model", str(model_factory("qwen3")), "--chat-template", str(fifo)
    )
    assert result.returncode == 2, result
    assert f"--chat-template {fifo} is a FIFO (named pipe)" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and seconds < 10


def test_a_model_path_that_is_a_fifo_exits_2_naming_it(fifo):
    result, seconds = serve_exits("--model", str(fifo))
    assert result.returncode == 2, result
    assert f"model {fifo} is a FIFO (named pipe)" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and seconds < 10


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_model_file_that_is_a_fifo_exits_2_naming_it(model_factory, tmp_path, name):
    model = Path(shutil.copytree(model_factory("qwen3"), tmp_path / "model"))
    (model / name).unlink()
    os.mkfifo(model / name)
    result, seconds = serve_exits("--model", str(model))
    assert result.returncode == 2, result
    assert f"model file {model / name} is a FIFO (named pipe)" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and seconds < 10


def test_devices_directories_and_long_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="/dev/zero is a character device, not a regular file"):
        read_text("/dev/zero", 100, "--api-key-file ")
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory"):
        open_regular(tmp_path)
    long = tmp_path / "long.jinja"
    long.write_bytes(b"x" * 101)
    with pytest.raises(ConfigError, match="is over 100 bytes"):
        read_text(long, 100)
    assert read_text(long, 101) == "x" * 101
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")


def test_text_reads_as_path_read_text_does(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_bytes("{{ a }}\r\nb\rc é".encode())
    assert read_text(path, 1 << 20) == path.read_text(encoding="utf-8")
    assert load_chat_template(str(path)) == path.read_text(encoding="utf-8")
    assert load_chat_template("{{ 'inline' }}\\n") == "{{ 'inline' }}\n"


def test_model_directory_checks_follow_links_and_skip_what_is_missing(tmp_path, fifo):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "README.md").symlink_to(fifo)  # not a file cpud reads
    (model / "merges.json").symlink_to(tmp_path / "gone")  # dangling: its reader says so
    check_model_files_are_regular(model)
    (model / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="tokenizer.json is a character device"):
        check_model_files_are_regular(model)
    (model / "tokenizer.json").unlink()
    templates = model / "additional_chat_templates"
    templates.mkdir()
    os.mkfifo(templates / "tool_use.jinja")
    with pytest.raises(ConfigError, match="tool_use.jinja is a FIFO"):
        check_model_files_are_regular(model)

"""Weight-loading progress: a bar on a terminal, a few log lines elsewhere."""

from __future__ import annotations

import io
import logging

from cpud.ranks.load_progress import LoadProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_ends_with_a_newline_at_100_percent():
    stream = Terminal()
    progress = LoadProgress("loading weights", stream)
    for done in range(1, 11):
        progress(done, 10)
    text = stream.getvalue()
    assert text.startswith("\rloading weights [")
    assert text.endswith("100% 10/10 tensors\n")
    assert "#" * 30 in text


def test_plain_log_lines_elsewhere_at_each_quarter(caplog):
    stream = io.StringIO()  # not a terminal: systemd's journal, a file
    progress = LoadProgress("loading weights", stream)
    with caplog.at_level(logging.INFO, logger="cpud.rank"):
        for done in range(1, 101):
            progress(done, 100)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[1].split("(")[0].strip() for line in lines] == [
        "25%",
        "50%",
        "75%",
        "100%",
    ]
    assert stream.getvalue() == ""


def test_loader_reports_every_tensor(model_factory):

    from cpud.engine.executor import runner_config
    from cpud.ranks.model_runner import ModelRunner
    from cpud.ranks.parallel import SingleRank
    from cpud.settings.config import EngineArgs, resolve_config

    model_dir = model_factory("llama")
    config = resolve_config(EngineArgs(dtype="float32", num_kv_blocks=8), model_dir)
    calls: list[tuple[int, int]] = []
    ModelRunner(
        runner_config(config), config.model, SingleRank(), lambda d, t: calls.append((d, t))
    )
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        count = len(f.keys())
    assert calls == [(i, count) for i in range(1, count + 1)]

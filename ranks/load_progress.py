"""Weight-loading progress: a bar redrawn in place on a terminal, a few plain log lines
elsewhere (systemd's journal, files)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("cpud.rank")
BAR_WIDTH = 30
LOG_STEPS = 4  # 25 %, 50 %, 75 %, 100 %


class LoadProgress:
    def __init__(self, label: str, stream: TextIO | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.on_terminal = self.stream.isatty()
        self.started = time.monotonic()
        self._drawn = 0.0
        self._logged = 0

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        fraction = done / total
        if self.on_terminal:
            now = time.monotonic()
            if done == total or now - self._drawn >= 0.1:
                self._drawn = now
                filled = int(fraction * BAR_WIDTH)
                bar = "#" * filled + "." * (BAR_WIDTH - filled)
                end = "\n" if done == total else ""
                self.stream.write(
                    f"\r{self.label} [{bar}] {fraction:4.0%} {done}/{total} tensors{end}"
                )
                self.stream.flush()
        elif int(fraction * LOG_STEPS) > self._logged:
            self._logged = int(fraction * LOG_STEPS)
            log.info(
                "%s: %.0f%% (%d/%d tensors, %.1f s)",
                self.label,
                100 * fraction,
                done,
                total,
                time.monotonic() - self.started,
            )

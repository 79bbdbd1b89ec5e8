"""Conversion stages: logged under the ``torchtpu_export`` logger, and shown as a progress bar on a TTY.

Code marks its stages with ``with progress.stage("lower"):``. Nothing is drawn unless the CLI
(or a user) enables a bar with ``progress.bar()``; even then the bar appears only on a terminal
and only once a conversion has run for ``delay`` seconds, so pipes, CI logs and quick
conversions stay quiet.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

log = logging.getLogger("torchtpu_export")

_active: "_Bar | None" = None


class _Bar:
    def __init__(self, stream, delay: float, interval: float = 0.2):
        self.stream, self.delay, self.interval = stream, delay, interval
        self.start = time.perf_counter()
        self.done: list[str] = []
        self.current: str | None = None
        self.drawn = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _line(self) -> str:
        marks = [f"\u2713 {s}" for s in self.done] + ([f"\u25b8 {self.current}"] if self.current else [])
        return f"\r[{time.perf_counter() - self.start:5.1f}s] " + "  ".join(marks) + "\x1b[K"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if time.perf_counter() - self.start >= self.delay:
                self.stream.write(self._line())
                self.stream.flush()
                self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.drawn:
            self.stream.write(self._line() + "\n")
            self.stream.flush()


@contextlib.contextmanager
def bar(stream=None, delay: float = 2.0, force: bool = False):
    """Enables the progress bar for the conversions inside the block (a no-op unless ``stream`` is a TTY)."""
    global _active
    stream = stream or sys.stderr
    if not (force or (hasattr(stream, "isatty") and stream.isatty())):
        yield
        return
    previous, _active = _active, _Bar(stream, delay)
    try:
        yield
    finally:
        _active.close()
        _active = previous


def clear_line() -> None:
    """Erases the bar's line before other output is printed (it is redrawn on its next tick)."""
    if _active is not None:
        _active.clear()


@contextlib.contextmanager
def stage(name: str):
    """Marks a conversion stage: timed in the log, shown in the bar when one is active."""
    t0 = time.perf_counter()
    if _active is not None:
        _active.current = name
    try:
        yield
    finally:
        log.info("%s: %.2f s", name, time.perf_counter() - t0)
        if _active is not None:
            _active.done.append(name)
            _active.current = None

"""Never silent for long: what the launcher says while a phase takes seconds.

* :func:`phase` — ``with phase("building sample indices"):`` says the label at once and, while the
  block runs, how long it has been running, every :data:`HEARTBEAT_S` (a line each time when the
  output is not a terminal; on a terminal a ``rich`` spinner).
* :class:`Meter` — progress over a known number of bytes (fingerprinting: MB and MB/s;
  tokenizing: documents, MB, tokens/s and an ETA): a ``rich`` progress bar on a terminal, plain
  lines every :data:`HEARTBEAT_S` otherwise. It says nothing for work done within
  :data:`QUIET_S` (a small corpus needs no progress display).

Torch-free, a bottom-layer module: data preparation, the pipeline and the launcher's wait use it.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional, TypeVar

HEARTBEAT_S = 2.0
"""Longest silence between two lines of a phase that is still running."""
QUIET_S = 1.0
"""Work that ends within this says nothing beyond its own summary line."""

T = TypeVar("T")
_ACTIVE: List[object] = []
"""The phases in progress, innermost last (only the innermost one beats)."""
Log = Callable[[str], None]


def say(message: str) -> None:
    print(f"[orchestrator] {message}", flush=True)


def _tty() -> bool:
    return sys.stdout.isatty()


def _eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s"


@contextmanager
def phase(label: str, log: Log = say, every: float = HEARTBEAT_S) -> Iterator[None]:
    """Say ``label`` now, then ``... label: N s`` every ``every`` seconds until the block ends."""
    log(label)
    if _tty():
        from rich.console import Console

        with Console().status(label):
            yield
        return
    done = threading.Event()
    start = time.monotonic()
    me = object()
    _ACTIVE.append(me)

    def beat() -> None:
        while not done.wait(every):
            if _ACTIVE and _ACTIVE[-1] is me:  # a phase inside this one speaks for both
                log(f"  ... {label}: {time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=beat, name="orchestrator-phase", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        _ACTIVE.remove(me)


class Meter:
    """Progress of ``label`` over ``total`` bytes; :meth:`advance` as they are processed, :meth:`close` at the end.

    ``counts`` (optional) returns the running counts to show beside the bytes, e.g.
    ``{"documents": 12, "tokens": 3400}``; a ``tokens`` count is also shown as a rate.
    """

    def __init__(
        self,
        label: str,
        total: int,
        counts: Optional[Callable[[], Dict[str, int]]] = None,
        log: Log = say,
        every: float = HEARTBEAT_S,
    ):
        self.label, self.total, self.counts, self.log, self.every = label, max(1, int(total)), counts, log, every
        self.done = 0
        self.start = self.last = time.monotonic()
        self.shown = False
        self.bar = None
        self.task = None

    def _text(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        mb, total_mb = self.done / 1e6, self.total / 1e6
        parts = [f"{mb:,.1f}/{total_mb:,.1f} MB ({mb / elapsed:,.1f} MB/s)"]
        counts = self.counts() if self.counts else {}
        parts += [f"{n:,} {name}" for name, n in counts.items()]
        if "tokens" in counts:
            parts.append(f"{counts['tokens'] / elapsed:,.0f} tokens/s")
        if 0 < self.done < self.total:
            parts.append(f"ETA {_eta(elapsed * (self.total - self.done) / self.done)}")
        return ", ".join(parts)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.start < QUIET_S:
            return
        if _tty():
            if self.bar is None:
                from rich.progress import BarColumn, Progress, TextColumn

                self.bar = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(), TextColumn("{task.description}"))
                self.task = self.bar.add_task("", total=self.total)
                self.bar.start()
            self.bar.update(self.task, completed=self.done, description=self._text(now))
        elif not self.shown or now - self.last >= self.every:
            self.log(f"  {self.label}: {self._text(now)}")
            self.shown, self.last = True, now

    def wrap(self, items: Iterable[T], size: Callable[[T], int]) -> Iterator[T]:
        """``items``, advancing by ``size(item)`` bytes as each is taken."""
        for item in items:
            self.advance(size(item))
            yield item

    def close(self) -> None:
        """Stop the bar; a meter that showed progress says its last state."""
        self.done = self.total  # every byte was read (the text of a JSONL line is shorter than the line)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
            self.bar.stop()
        if self.shown or self.bar is not None:
            self.log(f"  {self.label}: done, {self._text(time.monotonic())}")

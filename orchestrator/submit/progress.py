"""What a person watching the launcher sees: the job's phases, a progress bar, evaluations, where to look.

:class:`Progress` is polled by :func:`orchestrator.submit.wait.wait` while a job runs; it reads
two growing files and keeps no other state: ``<run.dir>/metrics.jsonl`` (training records and the
``start``/``eval``/``summary`` events the logging rank writes, :mod:`orchestrator.runtime.training.metrics`)
and rank 0's log (its ``[orchestrator] ...`` phase lines). :func:`final_lines` names the run
directory, the metrics file, the TensorBoard command and the latest checkpoint after the job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from orchestrator.ckpt.rundir import CHECKPOINTS_DIR, METRICS_FILE, TENSORBOARD_DIR
from orchestrator.config.schema import JobConfig
from orchestrator.meter import HEARTBEAT_S
from orchestrator.submit.run_records import RECENT_ITERS, remaining_s, steady_pace


def _eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class Tail:
    """New complete lines of a growing text file (metrics.jsonl, rank 0's log), from where it stood."""

    def __init__(self, path: Optional[Path], from_start: bool = False):
        self.path = path
        self.offset = 0 if from_start or path is None or not path.exists() else path.stat().st_size

    def lines(self) -> List[str]:
        if self.path is None or not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:  # rewritten (a requeued SLURM attempt): from the top
            self.offset = 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


PHASES = (
    ("rank 0 up", "importing torch and megatron-core"),
    ("ranks up", "building the model and optimizer"),
    ("building sample indices", "building sample indices"),
    ("sample indices built", "forking the ranks"),
    ("forked; joining", "joining the process group"),
    ("loading checkpoint", "loading the checkpoint"),
    ("training iterations", "first training step"),
    ("saving checkpoint", "saving the checkpoint"),
    ("waiting for ranks to exit", "waiting for the ranks to exit"),
)
"""(words in a rank-0 line, the phase it starts): what the heartbeat says is going on."""


def ranks_up(run_dir: Path, job_id: str) -> Callable[[], int]:
    """How many ranks of job ``job_id`` have started (their ``heartbeat/started_<r>`` files)."""
    from orchestrator.ckpt.rundir import HEARTBEAT_DIR

    def count() -> int:
        n = 0
        for path in (Path(run_dir) / HEARTBEAT_DIR).glob("started_*"):
            try:
                n += path.read_text().strip() == str(job_id)
            except OSError:
                continue
        return n

    return count


class Progress:
    """What a person watching the launcher sees while the job runs.

    * the job's phases: rank 0's ``[orchestrator]`` lines (ranks up, building model, loading or
      saving a checkpoint, ...), echoed as they appear in its log;
    * training: a rich bar on a terminal (plain lines otherwise) from the iteration the job starts at
      (a resumed job starts at its checkpoint's iteration) to ``training.train_iters``, with lm loss,
      step time, tokens/s and an ETA: samples (a batch ramp's later iterations are larger) or, without batch
      sizes in the records, iterations left x the pace of the newest records past the attempt's first
      iteration (:func:`~orchestrator.submit.run_records.steady_pace`);
    * every evaluation (validation lm loss and perplexity), and "waiting for ranks to exit" once the
      logging rank has written its summary.
    """

    def __init__(
        self,
        path: Path,
        total: int,
        enabled: bool = True,
        log: Optional[Path] = None,
        world_size: int = 0,
        ranks_up: Optional[Callable[[], int]] = None,
        every: float = HEARTBEAT_S,
    ):
        self.total = total
        self.metrics, self.log = Tail(path), Tail(log, from_start=True)
        self.last: Optional[Dict[str, Any]] = None
        self.records: List[Dict[str, Any]] = []  # the newest training records of the job, oldest first
        self.start_iteration: Optional[int] = None  # the job's start record: where its attempt began
        self.train_samples: Optional[int] = None  # the job's start record: what the ETA counts down
        self.bar = None
        self.enabled = enabled
        self.world_size, self.ranks_up, self.every = world_size, ranks_up, every
        self.said = self.since = time.monotonic()
        self.phase = f"starting {world_size} ranks" if world_size else "starting the job"
        self.all_up = False
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}")
            )
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def _enter(self, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()

    def _track(self, line: str) -> None:
        """The phase a rank-0 line starts (what the heartbeat names while nothing else is said)."""
        self.all_up = self.all_up or "ranks up" in line
        for words, phase in PHASES:
            if words in line:
                self._enter(phase)
                return

    def heartbeat(self) -> None:
        """Name the phase in progress when nothing was said for ``every`` seconds (polled: the
        launcher passes :data:`~orchestrator.meter.HEARTBEAT_S` less half its poll interval)."""
        now = time.monotonic()
        if not self.enabled or now - self.said < self.every:
            return
        text = f"{self.phase} ({now - self.since:.0f} s)"
        if self.ranks_up is not None and not self.all_up:
            text += f"; {self.ranks_up()}/{self.world_size} ranks started"
        self.said = now
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(f"  ... {text}", flush=True)

    def _say(self, line: str) -> None:
        self._track(line)
        self.said = time.monotonic()
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def poll(self) -> None:
        # Rank 0's lines first: its start-up phases (ranks forked, ranks up) precede the iterations that a
        # fast job logs within one poll (saves are metrics records, so they keep their place).
        for line in self.log.lines():
            if line.startswith("[orchestrator]"):
                self._say(line)
        for line in self.metrics.lines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                self._record(rec)
        self.heartbeat()

    def _record(self, rec: Dict[str, Any]) -> None:
        event = rec.get("event")
        if event is None and "lm_loss" in rec:
            self.last = rec
            self.records = self.records[-RECENT_ITERS:] + [rec]
            self._show(rec)
        elif event == "start":
            self.train_samples, self.start_iteration, self.records = rec.get("train_samples"), rec.get("iteration"), []
            if self.bar is not None:
                self.bar.update(self.task, completed=rec["iteration"], total=self.total)
            if rec.get("iteration"):
                loaded = f", loaded in {rec['load_s']:.2f} s" if rec.get("load_s") is not None else ""
                self._say(
                    f"[orchestrator] training iterations {rec['iteration'] + 1}..{self.total} "
                    f"(resumed at iteration {rec['iteration']}{loaded})"
                )
        elif event == "saved":
            self._say(saved_line(rec))
        elif event == "save_interval":  # checkpoint.save_interval=auto chose (runtime.training.save_schedule)
            self._say(
                f"[orchestrator] checkpoint.save_interval=auto: every {rec['interval']} iterations (next save at "
                f"{rec['next_save']}; C {rec['save_s']:.3g} s {rec['save_s_source']}, M {rec['mtbf_s'] / 3600:.3g} h, "
                f"step {rec['step_s']:.3g} s)"
            )
        elif event == "eval":
            self._say(
                f"[orchestrator] validation at iteration {rec['iteration']}: lm loss {rec['lm_loss']:.4f} | "
                f"ppl {rec['ppl']:.2f}"
            )
        elif event == "summary":
            self._say(
                f"[orchestrator] training {rec.get('status')} at iteration {rec.get('iteration')}; "
                "waiting for ranks to exit"
            )

    def _show(self, rec: Dict[str, Any]) -> None:
        self._enter(
            f"iteration {rec['iteration'] + 1}/{self.total}"
            if rec["iteration"] < self.total
            else "finishing: validation, the last checkpoint"
        )
        self.said = time.monotonic()
        if not self.enabled:
            return
        step_s, sample_s = steady_pace(self.records, self.start_iteration)
        left = remaining_s(rec["iteration"], self.total, step_s, rec, self.train_samples, sample_s)
        eta = f" | ETA {_eta(left)}" if left is not None else ""
        text = (
            f"loss {rec['lm_loss']:.4f} | {rec['step_time_s'] * 1000:.0f} ms/step | "
            f"{rec['tokens_per_s']:.0f} tok/s{eta}"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["iteration"], description=text)
        else:
            print(f"  iteration {rec['iteration']}/{self.total} | {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def saved_line(rec: Dict[str, Any]) -> str:
    """One line per save: size, the slowest rank's blocking and write times, what retention removed."""
    from orchestrator.ckpt.space import size_text

    name = Path(str(rec.get("path", ""))).name or f"iteration {rec.get('iteration')}"
    how = (
        f"training blocked {rec['blocking_s']:.2f} s, written in {rec['write_s']:.2f} s (async, completed "
        f"{time.strftime('%H:%M:%S', time.localtime(rec['completed']))})"
        if rec.get("async")
        else f"training blocked {rec['blocking_s']:.2f} s"
    )
    removed = f" | removed {', '.join(rec['removed'])}" if rec.get("removed") else ""
    return f"[orchestrator] saved {name}: {size_text(rec.get('bytes'))} | {how} (slowest rank){removed}"


def final_lines(cfg: JobConfig) -> str:
    """Where to look after a run: run directory, metrics file, TensorBoard command, latest checkpoint."""
    from orchestrator.ckpt.catalogue import latest_complete

    run_dir = Path(cfg.run.dir)
    latest = latest_complete(run_dir / CHECKPOINTS_DIR, lambda _: None, verify=False)
    lines = [f"run dir:     {run_dir}", f"metrics:     {run_dir / METRICS_FILE}"]
    if (run_dir / TENSORBOARD_DIR).is_dir():
        lines.append(f"tensorboard: tensorboard --logdir {run_dir / TENSORBOARD_DIR}")
    lines.append(f"checkpoint:  {latest.path if latest is not None else 'none saved'}")
    return "\n".join(f"[orchestrator] {line}" for line in lines)

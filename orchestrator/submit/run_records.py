"""What a run directory's records say, read from their end: the last iteration and loss, the live rates and
ETA inputs, the latest ``start`` and step breakdown, the straggler and slow-link lines. ``status`` reads them;
no torch import."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from orchestrator.ckpt.history import PathLike
from orchestrator.ckpt.rundir import METRICS_FILE
from orchestrator.submit.jobs import tail_text

TAIL_BYTES = 1 << 20
"""How much of the end of ``metrics.jsonl`` status reads (~3,000 records at ``log_interval=1``)."""


_START_PREFIX = b'{"event": "start"'
"""How a ``start`` record's line begins (records are written with sorted keys, :func:`orchestrator.io.append_jsonl`)."""


def _records_from_end(path: Path, max_bytes: int = TAIL_BYTES, only: Optional[str] = None):
    """The JSON object records of the last ``max_bytes`` of a JSONL file, newest first (torn lines skipped);
    ``only``: just the lines holding that text (the others are not parsed)."""
    for line in reversed(tail_text(path, max_bytes).splitlines()):
        if only is not None and only not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            yield rec


def records_backward(path: Path, needle: str, block: int = TAIL_BYTES) -> Iterator[Dict[str, Any]]:
    """The JSON records of a JSONL file whose line holds ``needle``, newest first, read backwards ``block`` bytes at a
    time over the whole file (only those lines are parsed): a record older than the last MiB is still found."""
    want = needle.encode()
    with open(path, "rb") as f:
        end, carry = f.seek(0, os.SEEK_END), b""
        while end > 0:
            begin = max(0, end - block)
            f.seek(begin)
            lines = (f.read(end - begin) + carry).split(b"\n")
            carry = lines.pop(0) if begin > 0 else b""  # a line cut by the block's start: finished by the next block
            for raw in reversed(lines):
                if want in raw:
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        yield rec
            end = begin


def last_metrics(run_dir: PathLike) -> Tuple[Optional[int], Optional[float], Optional[Dict[str, Any]]]:
    """(last iteration, last lm_loss, last summary record) from ``<run_dir>/metrics.jsonl``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None, None, None
    iteration = loss = None
    summary = next(_records_from_end(path, only='"event": "summary"'), None)
    summary = summary if (summary or {}).get("event") == "summary" else None
    for rec in _records_from_end(path):
        # Per-iteration records only: a summary of a job that resumed a finished run has no loss (NaN).
        if "iteration" in rec and "lm_loss" in rec and "event" not in rec:
            iteration, loss = rec["iteration"], rec["lm_loss"]
            break
    return iteration, loss, summary


def slowness(run_dir: PathLike) -> List[str]:
    """Lines naming the slow links (``link_check``) and stragglers (``straggler``) of the latest job, oldest first."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    lines: List[str] = []
    for rec in records_backward(path, '"event": "'):  # events only, back to the job's start, however far
        if rec.get("event") == "start":
            break
        if rec.get("event") == "straggler" and rec.get("line"):
            lines.append(str(rec["line"]))
        elif rec.get("event") == "link_check":
            lines.extend(str(line) for line in reversed(rec.get("slow") or []))
    return lines[::-1]


def latest_start(path: Path, block: int = TAIL_BYTES) -> Optional[Dict[str, Any]]:
    """The newest ``start`` record of a metrics file, searched backwards block by block (the fallback for
    a run whose ``jobs.jsonl`` does not carry ``train_iters``: runs written before it did)."""
    needle = b"\n" + _START_PREFIX
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            begin = max(0, end - block)
            f.seek(begin)
            chunk = (b"\n" if begin == 0 else b"") + f.read(end - begin + len(needle))  # overlap: no match lost
            at = chunk.rfind(needle)
            while at >= 0:
                f.seek(begin + at + (0 if begin == 0 else 1))
                try:
                    rec = json.loads(f.readline())
                except ValueError:
                    rec = None
                if isinstance(rec, dict):
                    return rec
                at = chunk.rfind(needle, 0, at)
            end = begin
    return None


def remaining_s(
    iteration: int, train_iters: int, step_s: Optional[float], rec: Dict[str, Any], train_samples, sample_s
) -> Optional[float]:
    """Seconds left of a run at ``iteration`` (``rec``: its newest training record): samples left
    (``train_samples`` of the job's ``start`` record less ``rec``'s ``consumed_samples``) x seconds per sample
    when both are known, so a batch ramp's later, larger iterations count as such; else iterations left x the
    step time ``step_s`` (the same number without a ramp). None when neither is known."""
    consumed = rec.get("consumed_samples")
    if isinstance(train_samples, int) and isinstance(consumed, int) and sample_s:
        return max(0, train_samples - consumed) * sample_s
    return None if step_s is None else max(0, train_iters - iteration) * step_s


RECENT_ITERS = 100
"""How many of the newest iterations the ETA's pace is measured over (:func:`steady_pace`)."""


def steady_pace(
    records: Sequence[Dict[str, Any]], start_iteration: Optional[int], recent_iters: int = RECENT_ITERS
) -> Tuple[Optional[float], Optional[float]]:
    """(seconds per iteration, seconds per sample) behind an ETA, from a job's training records (oldest first).

    A record's ``step_time_s`` is the mean over the iterations since the previous record (it spans ``iteration``
    less the previous record's, or less ``start_iteration`` for the attempt's first), so the pace is the median
    over the iterations of the newest records spanning about ``recent_iters`` iterations, each record weighted by
    the iterations it spans (a record of 100 iterations is 100 of them; the median: an iteration slowed by
    a warm-up, evaluation or a busy machine does not drag it), and seconds per sample likewise over the samples
    consumed in those spans (a batch ramp's iterations grow; ``batch_size`` x span where the previous
    ``consumed_samples`` is not known). The record of the attempt's first iteration (``start_iteration + 1``,
    logged alone: allocation, the first batches, a resumed job's load) is left out, as
    ``training.timing_warmup_iters`` leaves it out of the step-time median; with ``start_iteration`` None (the
    job's start not read) the oldest record only bounds the next one's span. (None, None) while no record past
    the first iteration is known."""
    steps: List[Tuple[float, float]] = []  # (seconds per iteration, iterations)
    per_sample: List[Tuple[float, float]] = []  # (seconds per sample, samples)
    iters = 0
    for i in range(len(records) - 1, -1, -1):
        rec, prev = records[i], records[i - 1] if i > 0 else None
        before = prev["iteration"] if prev is not None else start_iteration
        step = rec.get("step_time_s")
        if before is None or not isinstance(step, (int, float)) or rec["iteration"] <= before:
            break
        if start_iteration is not None and rec["iteration"] <= start_iteration + 1:
            break  # the attempt's first iteration: warm-up
        span = rec["iteration"] - before
        done = None if prev is None else prev.get("consumed_samples")
        if isinstance(done, int) and isinstance(rec.get("consumed_samples"), int):
            samples = rec["consumed_samples"] - done
        else:
            samples = (rec.get("batch_size") or 0) * span
        steps.append((step, span))
        per_sample.append((step * span / samples if samples > 0 else 0.0, samples))
        iters += span
        if iters >= recent_iters:
            break
    if not steps:
        return None, None
    known = all(n > 0 for _, n in per_sample)
    return weighted_median(steps), (weighted_median(per_sample) if known else None)


def weighted_median(pairs: Sequence[Tuple[float, float]]) -> float:
    """The median of ``(value, weight)`` pairs, each value counted ``weight`` times (the lower one on a tie)."""
    ordered = sorted(pairs)
    total, acc = sum(w for _, w in ordered), 0.0
    for value, weight in ordered:
        acc += weight
        if 2 * acc >= total:
            return value
    return ordered[-1][0]


def live_rates(run_dir: PathLike, records: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """``train_iters`` (the latest job's ``start`` event), ``tokens_per_s`` and ``step_time_s`` from
    ``<run_dir>/metrics.jsonl``: for a job that ended, its summary's (tokens per step / median step time after the
    warm-up, the figure of its last line); for a running one, the step and sample times of its newest records past
    the warm-up (:func:`steady_pace`, the ETA's pace) and the tokens/s of that pace (the newest record's tokens per
    iteration over its step time), so the rate and the ETA that ``status`` shows never disagree.

    Reads the last :data:`TAIL_BYTES` of the file, whatever its length: when the latest job's ``start``
    record lies further back (a long run), ``train_iters`` comes from that job's ``attempt_started``
    record in ``records`` (``jobs.jsonl``), and only for runs without one is the file searched backwards."""
    path = Path(run_dir) / METRICS_FILE
    out: Dict[str, Any] = {"train_iters": None, "tokens_per_s": None, "step_time_s": None}
    out.update({"train_samples": None, "sample_s": None, "newest": {}})
    if not path.exists():
        return out
    start = next((r for r in _records_from_end(path, only=_START_PREFIX.decode()) if r.get("event") == "start"), None)
    recent: List[Dict[str, Any]] = []
    summary: Optional[Dict[str, Any]] = None
    began = None  # the latest job's start iteration, when its start record is among the newest
    for rec in _records_from_end(path):
        if rec.get("event") == "start":
            began = rec.get("iteration")
            break
        if len(recent) > RECENT_ITERS:
            break  # the newest records of the latest job: enough for the pace (steady_pace)
        if rec.get("event") == "summary" and not recent:
            summary = rec  # the latest job ended: its own figure
        if "event" not in rec and isinstance(rec.get("tokens_per_s"), (int, float)):
            recent.append(rec)
    if start is not None:
        out["train_iters"], out["train_samples"] = start.get("train_iters"), start.get("train_samples")
    else:
        started = [r for r in records if r.get("event") == "attempt_started" and r.get("train_iters") is not None]
        start = {"train_iters": started[-1]["train_iters"]} if started else latest_start(path)
        out["train_iters"] = (start or {}).get("train_iters")
    median_step = (summary or {}).get("step_time_median_s")
    if median_step and (summary or {}).get("tokens_per_step"):  # what the job's last line said
        out["tokens_per_s"], out["step_time_s"] = summary["tokens_per_step"] / median_step, median_step
    elif recent:
        out["step_time_s"], out["sample_s"] = steady_pace(recent[::-1], began)
        out["newest"] = newest = recent[0]
        step_s = newest.get("step_time_s")
        if out["step_time_s"] and isinstance(step_s, (int, float)) and step_s > 0:
            # the ETA's pace (one fact): the newest record's tokens per iteration over it
            out["tokens_per_s"] = newest["tokens_per_s"] * step_s / out["step_time_s"]
        else:  # only the attempt's first iteration is known: its own rate
            out["tokens_per_s"] = newest["tokens_per_s"]
    return out


def latest_breakdown(run_dir: PathLike) -> Optional[Dict[str, Any]]:
    """The newest step breakdown of a run (``metrics.jsonl``): the latest window's ``breakdown`` record, or
    the job summary's (over its timed iterations) when that came after it; with ``what``, saying which.
    None when the run recorded none (``training.breakdown_interval=0``, or no window yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None
    window = next(records_backward(path, '"event": "breakdown"'), None)
    summary = next(records_backward(path, '"event": "summary"'), None)
    if (
        summary
        and (summary.get("breakdown") or {}).get("stages")
        and float(summary.get("time", 0)) >= float((window or {}).get("time", 0))
    ):
        return {
            **summary["breakdown"],
            "what": f"over the {summary.get('timed_iterations')} timed iterations "
            f"of the job that ended at iteration {summary.get('iteration')}",
        }
    if window and window.get("stages"):
        first, last = window.get("iterations") or ("?", window.get("iteration"))
        return {**window, "what": f"iterations {first}-{last}"}
    return None

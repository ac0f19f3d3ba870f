"""Where the logging rank's numbers go: ``metrics.jsonl`` always, TensorBoard and W&B when asked.

Only the logging rank (last pipeline stage, first TP/CP/DP rank: the one that holds the lm loss)
writes; every other rank gets a :class:`Trackers` whose methods do nothing.

* ``<run.dir>/metrics.jsonl`` (:data:`~orchestrator.ckpt.rundir.METRICS_FILE`): one JSON object per
  line. Training records have no ``event`` key::

      {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
       "batch_size", "num_microbatches", "throughput_tflops", "skipped", "max_rss_mb", "max_gpu_mem_mb", "time"}

  ``batch_size`` and ``num_microbatches`` are the record's iteration's (``training.rampup_batch_size`` ramps
  them); ``tokens_per_s`` counts each iteration since the last record with its own batch.

  ``lr`` is the learning rate that iteration's optimizer step applied (the schedule evaluated at
  ``iteration - 1`` completed steps, Megatron's formula). Other records carry ``event``:
  ``resumed``, ``eval`` (``iteration``, ``consumed_samples``, ``lm_loss``, ``ppl``, ``eval_iters``),
  ``saved`` (``iteration``, ``path``, ``bytes``, the slowest rank's ``blocking_s`` and ``write_s``,
  ``async``, ``started``, ``completed``, ``removed``, ``prune_s``: :mod:`orchestrator.runtime.training.saving`),
  ``stopped``, ``summary``, ``breakdown`` (the step per pipeline stage by category every
  ``training.breakdown_interval`` iterations: :mod:`orchestrator.runtime.training.breakdown`); ``start``
  carries ``load_s`` after a resume. The launcher streams this file
  for its progress display.
* TensorBoard (``logging.tensorboard``, on by default): event files under
  ``<run.dir>/tensorboard`` with Megatron-LM's tag names, each written twice — indexed by
  iteration (``lm loss``) and by consumed samples (``lm loss vs samples``): ``lm loss``,
  ``learning-rate``, ``grad-norm``, ``throughput`` (model TFLOP/s per rank, Megatron's meaning),
  ``tokens-per-sec``, ``iteration-time`` (s), ``batch-size``, ``mem-max-allocated-bytes`` (CUDA) or
  ``mem-max-rss-bytes`` (CPU), and after each evaluation ``lm loss validation`` and
  ``lm loss validation ppl``.
* W&B (``logging.wandb.project``; ``pip install orchestrator[wandb]``): the same names (without the
  ``vs samples`` copies; ``samples`` is logged as a value), step = iteration, run files under
  ``<run.dir>/wandb``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

from orchestrator.ckpt.rundir import METRICS_FILE, TENSORBOARD_DIR
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.io import append_jsonl

PPL_CAP = 20.0
"""Perplexity is reported as exp(min(loss, 20)), as Megatron-LM does (no overflow on early losses)."""


def perplexity(lm_loss: float) -> float:
    """exp(min(lm_loss, :data:`PPL_CAP`)); lm_loss in nats per token."""
    return math.exp(min(lm_loss, PPL_CAP))


def train_scalars(record: Dict[str, object]) -> Dict[str, float]:
    """TensorBoard/W&B scalars (Megatron-LM names) of one metrics.jsonl training record."""
    tags = {
        "lm loss": record["lm_loss"],
        "learning-rate": record["lr"],
        "grad-norm": record["grad_norm"],
        "throughput": record.get("throughput_tflops"),
        "tokens-per-sec": record["tokens_per_s"],
        "iteration-time": record["step_time_s"],
        "batch-size": record.get("batch_size"),
    }
    if record.get("max_gpu_mem_mb") is not None:
        tags["mem-max-allocated-bytes"] = float(record["max_gpu_mem_mb"]) * 2**20  # type: ignore[arg-type]
    elif record.get("max_rss_mb") is not None:
        tags["mem-max-rss-bytes"] = float(record["max_rss_mb"]) * 2**20  # type: ignore[arg-type]
    return {k: float(v) for k, v in tags.items() if v is not None}  # type: ignore[arg-type]


def eval_scalars(record: Dict[str, object]) -> Dict[str, float]:
    """TensorBoard/W&B scalars (Megatron-LM names) of one metrics.jsonl ``eval`` record."""
    return {
        "lm loss validation": float(record["lm_loss"]),  # type: ignore[arg-type]
        "lm loss validation ppl": float(record["ppl"]),
    }  # type: ignore[arg-type]


class _TensorBoard:
    """torch's SummaryWriter on ``<run.dir>/tensorboard``; flushed at every write (a reader may be
    watching the run, and a killed job must not lose what it logged)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), max_queue=1000, flush_secs=30)

    def write(self, scalars: Dict[str, float], iteration: int, samples: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, iteration)
            self.writer.add_scalar(f"{tag} vs samples", value, samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """One W&B run per job attempt; a requeued attempt resumes the same W&B run (id = run name +
    run directory hash), so the history continues."""

    def __init__(self, cfg: JobConfig):
        from orchestrator.runtime.rank.startup import let_wandb_in

        let_wandb_in()
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb.project is set but wandb is not installed; "
                "fix: pip install 'orchestrator[wandb]' or logging.wandb.project=null"
            ) from None
        import hashlib

        from orchestrator.config.schema import to_dict

        w = cfg.logging.wandb
        run_id = f"{cfg.run.name}-{hashlib.sha256(str(Path(cfg.run.dir).resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(cfg.run.dir),
            mode=w.mode,
            config=to_dict(cfg),
        )

    def write(self, scalars: Dict[str, float], iteration: int, samples: int) -> None:
        self.run.log({**scalars, "samples": samples}, step=iteration)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """metrics.jsonl + TensorBoard + W&B of one rank; inert unless ``enabled`` (the logging rank).

    Raises :class:`ConfigError` when W&B is asked for but not installed.
    """

    def __init__(self, cfg: JobConfig, enabled: bool):
        self.enabled = enabled
        self.path = Path(cfg.run.dir) / METRICS_FILE
        self._sinks: List[object] = []
        if not enabled:
            return
        if cfg.logging.tensorboard:
            self._sinks.append(_TensorBoard(Path(cfg.run.dir) / TENSORBOARD_DIR))
        if cfg.logging.wandb.project:
            self._sinks.append(_Wandb(cfg))

    def event(self, record: Dict[str, object]) -> None:
        """Append a record to metrics.jsonl only (``resumed``, ``saved``, ``stopped``, ``summary``)."""
        if self.enabled:
            append_jsonl(self.path, record)

    def train(self, record: Dict[str, object]) -> None:
        """A training record: metrics.jsonl, then the trackers."""
        if not self.enabled:
            return
        append_jsonl(self.path, record)
        self._fan_out(train_scalars(record), record)

    def eval(self, record: Dict[str, object]) -> None:
        """An ``eval`` record: metrics.jsonl, then the trackers."""
        if not self.enabled:
            return
        append_jsonl(self.path, record)
        self._fan_out(eval_scalars(record), record)

    def goodput(self, run_dir: Path, iteration: int, samples: int) -> Optional[Dict[str, object]]:
        """The run's goodput so far (every attempt, this one live: ckpt.goodput), for the job summary; its ETTR
        goes to the trackers as ``goodput ettr`` at ``iteration``. None on a rank that does not log."""
        if not self.enabled:
            return None
        from orchestrator.ckpt.goodput import account

        acc = account(run_dir)
        if acc is None or acc.ettr is None:
            return None
        for sink in self._sinks:
            sink.write({"goodput ettr": acc.ettr}, iteration, samples)  # type: ignore[attr-defined]
        return acc.as_dict()

    def _fan_out(self, scalars: Dict[str, float], record: Dict[str, object]) -> None:
        for sink in self._sinks:
            sink.write(scalars, int(record["iteration"]), int(record["consumed_samples"]))  # type: ignore[attr-defined]

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()  # type: ignore[attr-defined]
        self._sinks = []

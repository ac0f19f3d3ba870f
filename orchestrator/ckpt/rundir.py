"""What a run directory holds, by name (``<run.root>/<run.name>/``). Defined once, used everywhere.

::

    <run.dir>/
      metrics.jsonl        per-iteration records and the job summary (runtime, read by status/sweep)
      jobs.jsonl           attempt history: submissions and job events (ckpt.history)
      orchestrator.lock    the run lock (ckpt.lock)
      config.yaml          the resolved config of the run that started (entry)
      checkpoints/iter_XXXXXXX/{..., manifest.json}
      submitit/            submitit's job scripts, logs and result pickles
      tensorboard/         TensorBoard event files (runtime.metrics, logging rank)
      heartbeat/rank_<r>   each rank's progress and liveness, attempt-end markers (runtime.watchdog)
      heartbeat/ranks      every rank's heartbeat, a slot per rank: what the launcher reads (runtime.heartbeat)
      heartbeat/started_<r>  the job id, written as rank r's process starts (the launcher counts ranks up)
      stacks/rank_<r>.txt  every live rank's Python stacks when the hang watchdog fires
      stop.json            a stop asked of the live job (`orchestrator stop`, a signal to its launcher: ckpt.stop)
"""

from pathlib import Path
from typing import Union

METRICS_FILE = "metrics.jsonl"
JOBS_FILE = "jobs.jsonl"
LOCK_FILE = "orchestrator.lock"
CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
SUBMITIT_DIR = "submitit"
HEARTBEAT_DIR = "heartbeat"
STACKS_DIR = "stacks"
TENSORBOARD_DIR = "tensorboard"
STOP_FILE = "stop.json"


def metrics_path(run_dir: Union[str, Path]) -> Path:
    """``<run_dir>/metrics.jsonl``."""
    return Path(run_dir) / METRICS_FILE


def started_path(run_dir: Union[str, Path], rank: int) -> Path:
    """``<run_dir>/heartbeat/started_<rank>``: holds the id of the job whose rank ``rank`` has started."""
    return Path(run_dir) / HEARTBEAT_DIR / f"started_{rank}"

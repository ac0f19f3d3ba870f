"""Never silent: every phase of a run says what it does, in order, and ``status`` shows a live run's pace.

* :mod:`orchestrator.meter` on its own: a phase names itself at once and then its elapsed time
  while it lasts; a byte meter reports MB, counts, tokens/s and an ETA (plain lines off a terminal).
* One real run (gpt_tiny, PP=2 on 2 CPU ranks, forked): the launcher's lines come in the order of
  the phases, and while it trains ``status --json`` gives iteration/total, tokens/s and an ETA;
  then it is interrupted (exit 130).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from orchestrator.meter import Meter, phase


def _eta_s(line: str) -> float:
    minutes, seconds = re.search(r"ETA (\d+)m(\d+)s", line).groups()
    return 60 * int(minutes) + int(seconds)


@pytest.mark.parametrize(
    "start,total,records",
    [  # (iteration, step_time_s: the mean since the previous record): what the tester's runs logged
        (0, 40, [(1, 9.6), (15, 0.176)]),  # log_interval=100 on 40 iterations: 25 x 0.176 s left, not 2m49s
        (0, 400, [(1, 8.0), (82, 0.151)]),  # log_interval=100 on 400: 318 x 0.151 s (~48 s), not 3m21s
        (100, 200, [(101, 5.0), (119, 0.229)]),  # resumed at 100: 81 x 0.229 s (~18 s), not 1m30s
        (0, 400, [(1, 9.0)] + [(i, 0.15) for i in range(2, 9)]),  # log_interval=1: the first step's 9 s fades
    ],
)
def test_the_eta_is_the_iterations_left_at_the_steady_step_time(tmp_path, capsys, start, total, records):
    from orchestrator.submit.progress import Progress
    from orchestrator.submit.run_records import live_rates

    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    progress = Progress(path, total)
    lines = [{"event": "start", "iteration": start, "train_iters": total, "train_samples": total * 4}]
    lines += [
        {
            "iteration": it,
            "consumed_samples": 4 * it,
            "lm_loss": 5.0,
            "step_time_s": step,
            "tokens_per_s": 1.0,
            "batch_size": 4,
        }
        for it, step in records
    ]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    progress.poll()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  iteration ")]
    assert len(said) == len(records) and "ETA" not in said[0], said  # the first iteration alone: no pace yet
    last, step = records[-1]
    truth = (total - last) * step
    assert _eta_s(said[-1]) == pytest.approx(truth, rel=0.2, abs=1), (said[-1], truth)
    rates = live_rates(tmp_path)  # status's ETA: the same pace
    assert rates["step_time_s"] == pytest.approx(step, rel=0.2) and rates["sample_s"] == pytest.approx(
        step / 4, rel=0.2
    )


def test_a_phase_names_itself_then_its_elapsed_time():
    said = []
    with phase("building sample indices", log=said.append, every=0.05):
        time.sleep(0.18)
    assert said[0] == "building sample indices"
    beats = said[1:]
    assert 2 <= len(beats) <= 4 and all(b.startswith("  ... building sample indices: ") for b in beats), said
    said.clear()
    with phase("preparing data", log=said.append, every=0.05):
        with phase("loading the tokenizer", log=said.append, every=0.05):
            time.sleep(0.18)
    assert said[:2] == ["preparing data", "loading the tokenizer"]
    assert all(b.startswith("  ... loading the tokenizer: ") for b in said[2:]) and len(said) >= 4, said


def test_a_meter_reports_bytes_counts_rate_and_eta(monkeypatch):
    import orchestrator.meter as meter

    monkeypatch.setattr(meter, "QUIET_S", 0.0)
    said, counts = [], {"documents": 0, "tokens": 0}
    m = Meter("tokenizing", 4_000_000, counts=lambda: dict(counts), log=said.append, every=0.0)
    for _ in range(2):
        counts["documents"] += 10
        counts["tokens"] += 5000
        time.sleep(0.01)
        m.advance(1_000_000)
    m.close()
    assert said[0].startswith("  tokenizing: 1.0/4.0 MB (") and "10 documents, 5,000 tokens, " in said[0]
    assert "tokens/s, ETA 0m00s" in said[1] and "2.0/4.0 MB" in said[1]
    assert said[-1].startswith("  tokenizing: done, 4.0/4.0 MB") and "ETA" not in said[-1]


ITERS = 5000
"""More iterations than the job trains while `status` runs on a loaded machine (it is interrupted)."""
ORDER = [
    "[orchestrator] composing ",
    "[orchestrator] run progress: ",
    "[orchestrator] world size 2 = TP 1 x PP 2",
    "[orchestrator] preparing data (data=mock)",
    "[orchestrator] submitted job ",
    "[orchestrator] rank 0 up: importing torch and megatron-core, then forking ranks 1..1",
    "[orchestrator] building sample indices (megatron-core GPTDataset)",
    "[orchestrator] sample indices built",
    "[orchestrator] ranks 1..1 forked; joining the process group",
    "[orchestrator] 2 ranks up (gloo on cpu); building model gpt_tiny",
    f"  iteration 1/{ITERS} | loss ",
    f"  iteration 3/{ITERS} | loss ",
]


@pytest.mark.slow
def test_the_launcher_says_each_phase_in_order_and_status_shows_the_pace(tmp_path, cache_dir):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", ORCHESTRATOR_CACHE=str(tmp_path / "cache"))
    run_dir = tmp_path / "runs" / "progress"
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "model=gpt_tiny",
        "parallelism=pp2_dp2",
        "parallelism.data_parallel_size=1",
        "data=mock",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        f"training.train_iters={ITERS}",
        "training.log_interval=1",
        "training.eval_iters=0",
        "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false",
        "logging.tensorboard=false",
        f"run.root={tmp_path}/runs",
        "run.name=progress",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # SIGINT's default: pytest may run as a shell's background job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(f"  iteration 3/{ITERS}"):
                break
        live = subprocess.run(
            [sys.executable, "-m", "orchestrator", "status", "--json", str(tmp_path / "runs")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, "\n".join(lines) + rest
    # (rank 0's "params on rank 0" line may follow the first iterations: it is printed after the first step)
    phases = [next((i for i, line in enumerate(lines) if line.startswith(start)), None) for start in ORDER]
    assert None not in phases and phases == sorted(phases), "\n".join(lines)  # each phase, in this order
    record = json.loads(live.stdout.splitlines()[0])
    assert record["run_dir"] == str(run_dir) and record["state"] == "running", record
    assert record["train_iters"] == ITERS and record["iteration"] >= 3
    assert record["tokens_per_s"] > 0 and record["eta_s"] > 0
    seconds_per_step = record["eta_s"] / (ITERS - record["iteration"])
    assert record["tokens_per_s"] == pytest.approx(4 * 128 / seconds_per_step, rel=0.5)  # GBS x seq / step time

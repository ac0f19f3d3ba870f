"""``python -m orchestrator tune [overrides] [tune.*]``: measure few layouts, keep the fastest.

    python -m orchestrator tune +experiment=gpt_pp2_dp2 tune.max_trials=6 tune.max_minutes=20
    python -m orchestrator +experiment=gpt_pp2_dp2_tuned          # run the winner

Reads top to bottom (:meth:`Tuner.run`):

1. Compose the base config from the Hydra overrides (:func:`~orchestrator.config.compose.compose_config`);
   ``tune.*`` options go to :class:`~orchestrator.sweep.search.TuneConfig`.
2. Enumerate every layout of its world size and global batch (:func:`~orchestrator.sweep.search.candidates`,
   each through the one ``validate``), price each on the device that runs (``cpu`` for CPU ranks,
   else the ``gpu`` preset) with its device profile -- stored calibration, or the prior -- and drop
   those predicted above ``tune.memory_margin`` x the memory per rank.
3. Run the candidate with the lowest optimistic step (its prediction less ``tune.explore`` standard deviations
   of the model's uncertainty, :func:`~orchestrator.plan.calibrate.step_spread`: early trials also pin down
   what the first ones left to the prior) as a real job: ``python -m orchestrator <overrides> <knobs>``
   with ``tune.iters`` iterations, no checkpoint, in ``<run.root>/tune/<name>/<n>``; record it as a
   sweep point (``point.json``). Fit the device profile to every trial so far
   (:func:`~orchestrator.plan.calibrate.fit_profile`), store it (``tune.calibrate``), re-price the
   rest, and repeat until :func:`~orchestrator.sweep.search.stop_reason` says stop.
4. Write the sweep table (``summary.csv/.md/.png`` with predicted vs measured step time and memory),
   ``candidates.csv`` (every valid candidate, predicted, and what became of it) and the winner as
   ``./conf/experiment/<name>.yaml`` (``tune.out``; ./conf is searched ahead of the shipped conf/, see
   :mod:`orchestrator.config.confdirs`) with the evidence in its header.

A crashed trial is recorded; an out-of-memory crash lowers the memory margin below its prediction,
another crash rules out the remaining candidates that share its untested options. SLURM: with
``cluster=slurm...`` the trials run in sequence within one allocation (the warm ranks' job, sized
``tune.max_minutes`` + ``tune.trial_timeout_min``); ``tune.warm_pool=false`` makes each trial its
own job, submitted and waited for in sequence. Trials run on warm ranks (:mod:`orchestrator.sweep.trial`):
the process start-up is paid once, not per trial. Exit code: 0 with a winner, 1 when no trial completed, 2 for
a user error (one ``error:`` line, nothing created).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.io import write_atomic
from orchestrator.plan.calibrate import fit_profile, sample_of, step_spread
from orchestrator.sweep import search
from orchestrator.sweep.records import POINT_FILE
from orchestrator.sweep.render import short_reason, to_markdown
from orchestrator.sweep.search import Candidate, TuneConfig
from orchestrator.sweep.table import write_summary
from orchestrator.sweep.trial import Trial, TrialRunner, trial_overrides, trial_record
from orchestrator.sweep.tune_options import compose_base, help_or_usage, split_args
from orchestrator.sweep.winner import candidates_csv, evidence, experiment_yaml, run_flags

CANDIDATES_CSV = "candidates.csv"
_SKIP_BASE = ("run.", "hydra.", "plan=", "dry_run=")
"""Base overrides a trial replaces (its own run directory; it must run)."""


def say(message: str) -> None:
    print("\n".join(f"[tune] {line}" for line in str(message).splitlines()), flush=True)


class Tuner:
    """One tune session: the base config, its candidates, the device profile, the trials."""

    def __init__(self, base, overrides: List[str], opts: TuneConfig, tune_args: Sequence[str] = ()):
        from orchestrator.config.layout import layout_from_config
        from orchestrator.plan.inputs import gpu_preset
        from orchestrator.plan.profile import device_key, device_of, load_profile, prior_profile

        self.base, self.opts, self.tune_args = base, opts, [a for a in tune_args if not a.startswith("tune.out=")]
        self.overrides = [o for o in overrides if not o.lstrip("+~").startswith(_SKIP_BASE)]
        self.name = opts.name or re.sub(r"[^A-Za-z0-9_]+", "_", str(base.run.name)) + "_tuned"
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.name):
            raise ConfigError(
                f"tune.name={self.name!r}: must be a file and experiment name (letters, digits, _ . -); "
                "fix: tune.name=my_tuned"
            )
        self.root = Path(base.run.root) / "tune" / self.name
        self.device = device_of(base)
        layout = layout_from_config(base)
        preset = gpu_preset(self.device, ranks_on_host=layout.world_size // max(1, base.cluster.nodes))
        self.key = device_key(self.device)
        self.prior = prior_profile(preset, self.key)
        stored = load_profile(self.key, base.data.cache_dir)
        self.samples: List[Dict[str, Any]] = list(stored.samples) if stored else []
        self.profile = stored or self.prior
        self.margin = opts.memory_margin
        self.trials: List[Trial] = []
        self.runner: Optional[TrialRunner] = None
        self.start = time.time()
        self.cands, self.rejected = search.candidates(base, opts)
        self.cands_world = layout.world_size

    # ---- choosing ---------------------------------------------------------------------------
    def _price(self) -> None:
        """Re-plan every candidate with the current profile; mark those over the memory margin."""
        search.price(
            self.cands, self.device, self.profile, step_spread(self.prior, self.profile, self.opts.model_error_floor)
        )
        for c in self.cands:
            if c.status in ("candidate", "pruned_memory"):
                c.status = "candidate" if search.fits(c, self.opts, self.margin) else "pruned_memory"

    def _suspects(self) -> List[set]:
        crashed = [t.cand for t in self.trials if t.status == "failed" and not search.is_oom(t.reason)]
        return search.suspects(crashed, [t.cand for t in self.trials if t.status == "completed"])

    def remaining(self) -> List[Candidate]:
        sus = self._suspects()
        out = []
        for c in self.cands:
            if c.status == "candidate" and search.blocked(c, sus):
                c.status, c.note = (
                    "blocked",
                    "shares the options " + ", ".join(sorted(search.blocked(c, sus))) + " of a crashed trial",
                )
            if c.status == "candidate":
                out.append(c)
        return search.ranked(out, self.opts.explore)

    def stop(self) -> Optional[str]:
        done = [t for t in self.trials if t.wall_s]
        next_s = sum(t.wall_s for t in done) / len(done) if done else 0.0
        outcomes = [
            search.TrialOutcome(t.step_s, t.predicted_step_s, t.calibrated, t.predicted_sd, t.exploring)
            for t in self.trials
        ]
        left = self.remaining()
        return search.stop_reason(
            self.opts,
            outcomes,
            [c.plan.step_time_s for c in left],
            time.time() - self.start,
            next_s,
            [c.spread for c in left],
        )

    # ---- running ----------------------------------------------------------------------------
    def run_trial(self, cand: Candidate) -> Trial:
        best = min((t.step_s for t in self.trials if t.step_s), default=None)
        trial = Trial(
            len(self.trials),
            cand,
            cand.plan.step_time_s,
            cand.plan.peak_bytes,
            self.profile.calibrated,
            cand.spread,
            exploring=best is not None and cand.plan.step_time_s >= best,
        )
        cand.status = "running"
        self.trials.append(trial)
        run_dir = self.root / str(trial.num)
        self._record(trial)
        say(
            f"trial {trial.num}: {cand.label} (predicted {trial.predicted_step_s * 1e3:.1f} ms/step ± {trial.predicted_sd:.0%}, "
            f"{trial.predicted_peak_bytes / search.MiB:,.0f} MiB/rank{'; exploring' if trial.exploring else ''})"
        )
        args = [*self.overrides, *cand.overrides, *trial_overrides(self.opts, self.root, trial.num)]
        trial.summary, trial.reason, trial.wall_s = self.runner.run(args, run_dir)
        trial.status = "completed" if trial.summary else "failed"
        cand.status = trial.status
        self._record(trial)
        step = trial.step_s
        say(
            f"trial {trial.num}: {trial.status} in {trial.wall_s:.0f} s"
            + (f" ({trial.startup_s:.1f} s start-up)" if trial.startup_s is not None else "")
            + (
                f": {step * 1e3:.1f} ms/step (predicted {(trial.predicted_step_s - step) / step:+.0%} off, as the "
                f"table's step error), "
                f"{cand.layout.tokens_per_step / step:,.0f} tokens/s"
                if step
                else f": {short_reason(trial.reason)}"
            )
        )
        return trial

    def learn(self, trial: Trial) -> None:
        """Fit the profile to every completed trial (stored when ``tune.calibrate``); after an OOM, lower the margin."""
        from orchestrator.plan import memory as planner
        from orchestrator.plan.profile import save_profile

        if trial.status == "failed" and search.is_oom(trial.reason):
            limit = search.memory_limit_bytes(trial.cand, self.opts)
            self.margin = search.margin_after_oom(self.margin, trial.predicted_peak_bytes, limit)
            say(f"out of memory: memory margin lowered to {self.margin:.2f} of {limit / search.MiB:,.0f} MiB")
        if trial.status == "completed" and trial.summary:
            raw = planner.plan(trial.cand.cfg, gpu=self.device, profile=None)
            self.samples.append(sample_of(raw, trial.summary, " ".join(trial.cand.overrides), self.prior.cores))
            self.profile = fit_profile(self.prior, self.samples)
            if self.opts.calibrate:
                save_profile(self.profile, self.base.data.cache_dir)
        self._price()

    def _record(self, trial: Trial) -> None:
        """The trial as a sweep point (``point.json``), then the sweep table rebuilt."""
        run_dir = self.root / str(trial.num)
        record = trial_record(trial, run_dir, self.opts)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / POINT_FILE, json.dumps(record, indent=1, default=str) + "\n")
        write_summary(self.root)

    # ---- the session ------------------------------------------------------------------------
    def winner_path(self) -> Path:
        from orchestrator.config.confdirs import USER_CONF

        return Path(self.opts.out) if self.opts.out else Path(USER_CONF) / "experiment" / f"{self.name}.yaml"

    def preflight(self) -> None:
        """Refuse, before anything is created, what would overwrite or cannot run (ConfigError)."""
        if self.root.exists() and any(self.root.iterdir()):
            raise ConfigError(
                f"tune.name={self.name}: {self.root} already holds a tune; "
                f"fix: tune.name=<another name>, or remove {self.root}"
            )
        out = self.winner_path()
        if out.exists():
            key = f"tune.out={self.opts.out}" if self.opts.out else f"tune.name={self.name}"
            raise ConfigError(
                f"{key}: {out} exists (the winner would replace it); "
                "fix: tune.name=<a new experiment name> or tune.out=<a new file>"
            )
        if not self.cands:
            refused = ", ".join(f"{n} x {why}" for why, n in sorted(self.rejected.items())[:3])
            raise ConfigError(
                f"tune.tp/pp/vpp/mbs/...: no layout of world size "
                f"{self.cands_world} and global batch {self.base.training.global_batch_size} passes "
                f"validate ({refused or 'nothing to enumerate'}); fix: widen the tune.* lists or "
                "change the base config's parallelism / training.global_batch_size"
            )

    def run(self) -> int:
        self.preflight()
        self._price()
        self._announce()
        if self.opts.dry_run:
            return 0
        self.root.mkdir(parents=True, exist_ok=True)
        if self.base.cluster.kind in ("hosts", "torchrun"):  # torchrun's agents: a fresh job per trial
            self.opts.warm_pool = False
        self.runner = TrialRunner(self.opts, self.root)
        reason = self.stop()
        try:
            while reason is None:
                self.learn(self.run_trial(self.remaining()[0]))
                reason = self.stop()
        except KeyboardInterrupt:
            self.runner.close(interrupted=True)  # a SLURM pool is not cancelled: its ranks exit after the trial
            if self.trials and self.trials[-1].status == "running":
                trial = self.trials[-1]
                trial.status, trial.reason = "interrupted", "interrupted (Ctrl-C) while running"
                trial.cand.status = "interrupted"
                self._record(trial)
            self.finish("interrupted (Ctrl-C)")
            return 130
        self.runner.close()
        return self.finish(reason)

    def _announce(self) -> None:
        pruned = sum(c.status == "pruned_memory" for c in self.cands)
        rank = self.remaining()
        say(
            f"{self.name}: {len(self.cands)} valid candidates on {self.device} "
            f"({sum(self.rejected.values())} combinations refused by validate), {pruned} predicted over "
            f"{self.margin:.0%} of the memory per rank, {len(rank)} to choose from"
        )
        say(f"device profile {self.profile.summary()}")
        say(
            f"the first 10 in the order tune runs them (lowest prediction less tune.explore={self.opts.explore:g} sd "
            "first): predicted step ± sd, predicted peak per rank"
        )
        for c in rank[:10]:
            say(
                f"  {c.plan.step_time_s * 1e3:8.1f} ms ± {c.spread:4.0%}  {c.plan.peak_bytes / search.MiB:8,.0f} MiB  "
                f"{c.label}"
            )

    def finish(self, reason: str) -> int:
        """Table, candidates.csv, the winner's experiment file; the exit code."""
        say(f"stopped: {reason}")
        rows, _ = write_summary(self.root)
        write_atomic(self.root / CANDIDATES_CSV, candidates_csv(self.cands, self.trials))
        print(to_markdown(rows, self.device), flush=True)
        done = [t for t in self.trials if t.step_s]
        if self.opts.calibrate and done:
            from orchestrator.plan.profile import profile_path

            say(f"device profile stored: {profile_path(self.key, self.base.data.cache_dir)}")
        if not done:
            say(f"no trial completed; trials in {self.root}")
            return 1
        best = min(done, key=lambda t: t.step_s)
        path = self.write_winner(best, reason)
        say(
            f"winner: trial {best.num}: {best.cand.label}: {best.cand.layout.tokens_per_step / best.step_s:,.0f} "
            f"tokens/s, {best.step_s * 1e3:.1f} ms/step"
        )
        say(f"written: {path}\nrun it: python -m orchestrator {run_flags(path)}+experiment={self.name}")
        say(
            f"table: {self.root / 'summary.md'}, {self.root / 'summary.csv'}, {self.root / 'summary.png'}; "
            f"candidates: {self.root / CANDIDATES_CSV}"
        )
        return 0

    def write_winner(self, best: Trial, reason: str) -> Path:
        path = self.winner_path()
        header = evidence(self, best, reason)
        text = experiment_yaml(self.name, self.overrides, best.cand.overrides, header)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
        return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Tune (exit 0 with a winner, 1 when no trial completed); 2 with one ``error:`` line for a user error; a bare
    ``tune`` and ``--help``: :func:`~orchestrator.sweep.tune_options.help_or_usage`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    shown = help_or_usage(argv, __doc__)
    if shown is not None:
        return shown
    try:
        from orchestrator.config.confdirs import with_config_dir_flags
        from orchestrator.submit.signals import SIGNALS, interrupt

        for sig in SIGNALS:  # SIGTERM, SIGHUP as Ctrl-C: the table is written, warm SLURM ranks are not cancelled
            signal.signal(sig, interrupt)
        tune_args, overrides = split_args(with_config_dir_flags(argv))
        opts = search.parse_tune_args(tune_args)
        tuner = Tuner(compose_base(overrides), overrides, opts, tune_args)
        return tuner.run()
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())

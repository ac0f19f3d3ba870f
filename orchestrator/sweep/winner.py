"""The tuner's winner as an experiment file: ``conf/experiment/<name>.yaml``, runnable with ``+experiment=<name>``
(:func:`run_flags`: the ``--config-dir`` that finds it), its header's evidence (:func:`evidence`), and the
tune's ``candidates.csv`` (:func:`candidates_csv`)."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from orchestrator.config.compose import CONFIG_GROUPS
from orchestrator.sweep import search
from orchestrator.sweep.render import short_reason


def experiment_yaml(name: str, base_overrides: Sequence[str], knobs: Sequence[str], header: Sequence[str]) -> str:
    """``conf/experiment/<name>.yaml`` text: the base overrides and the winner's knobs, runnable with
    ``+experiment=<name>``; ``header`` lines become its leading comment.

    Group choices become ``override /group: option`` defaults, ``+experiment=X`` includes
    ``/experiment/X``, dotted keys become values; the knobs win over the base (written last).
    """
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    defaults: List[Any] = []
    values: Dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        node = values
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    knob_keys = {k.partition("=")[0] for k in knobs}
    for o in OverridesParser.create().parse_overrides(list(base_overrides)):
        key = o.key_or_group
        if o.is_delete() or key in knob_keys:
            continue
        if key == "experiment":
            defaults.append(f"/experiment/{o.value()}")
        elif key in CONFIG_GROUPS:
            defaults.append({f"override /{key}": o.value()})
        else:
            put(key, o.value())
    for o in OverridesParser.create().parse_overrides(list(knobs)):
        put(o.key_or_group, o.value())
    put("run.name", name)
    body = yaml.safe_dump({"defaults": defaults + ["_self_"], **values}, sort_keys=False, default_flow_style=False)
    comment = "\n".join(f"# {line}".rstrip() for line in header)
    return f"# @package _global_\n{comment}\n{body}"


def run_flags(path: Path) -> str:
    """What ``python -m orchestrator`` needs, from this directory, to find the experiment file ``path``."""
    from orchestrator.config.confdirs import conf_dir, user_conf_dirs

    root = path.resolve().parent.parent
    if path.parent.name != "experiment":
        return f"--config-dir <a directory whose experiment/ holds {path.name}> "
    return "" if root in [conf_dir().resolve(), *user_conf_dirs()] else f"--config-dir {root} "


def candidates_csv(cands: Sequence[Any], trials: Sequence[Any]) -> str:
    """``candidates.csv`` of a tune: every valid candidate (the search's order), predicted, and its trial's measure."""
    by_cand = {id(t.cand): t for t in trials}
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "candidate",
            "predicted_step_time_s",
            "predicted_step_sd_pct",
            "predicted_peak_mib",
            "status",
            "trial",
            "measured_step_time_s",
            "overrides",
        ]
    )
    for c in search.ranked(cands):
        t = by_cand.get(id(c))
        w.writerow(
            [
                c.label,
                c.plan.step_time_s,
                round(100 * c.spread, 1),
                c.plan.peak_bytes / search.MiB,
                c.status,
                "" if t is None else t.num,
                "" if t is None or t.step_s is None else t.step_s,
                " ".join(c.overrides),
            ]
        )
    return buf.getvalue()


def evidence(tuner: Any, best: Any, reason: str) -> List[str]:
    """The winner file's header: how ``tuner`` (a :class:`~orchestrator.sweep.tune.Tuner`) chose ``best`` (its
    fastest :class:`~orchestrator.sweep.trial.Trial`), every measured trial, where the evidence lies."""
    done = sorted((t for t in tuner.trials if t.step_s), key=lambda t: t.step_s)
    lay = best.cand.layout
    peak = max((best.summary or {}).get("peak_rss_mb_per_rank") or [0])
    lines = [
        f"Tuned by `python -m orchestrator tune {' '.join(tuner.overrides + tuner.tune_args)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}, device {tuner.key}.",
        f"{len(tuner.cands)} valid candidates, {sum(c.status == 'pruned_memory' for c in tuner.cands)} "
        f"pruned by memory (margin {tuner.margin:.2f}), {len(tuner.trials)} trials of {tuner.opts.iters} "
        f"iterations ({tuner.opts.warmup_iters} untimed); stopped: {reason}.",
        f"Winner (trial {best.num}): {best.cand.label}: {lay.tokens_per_step / best.step_s:,.0f} tokens/s, "
        f"median step {best.step_s * 1e3:.1f} ms (predicted {best.predicted_step_s * 1e3:.1f} ms), "
        f"peak {peak:,.0f} MiB/rank (predicted {best.predicted_peak_bytes / search.MiB:,.0f} MiB).",
        "Measured trials, fastest first:",
    ]
    lines += [f"  {t.step_s * 1e3:8.1f} ms  {t.cand.label}" for t in done]
    lines += [f"  failed: {t.cand.label}: {short_reason(t.reason, 100)}" for t in tuner.trials if t.status == "failed"]
    lines.append(f"Evidence: {tuner.root} (summary.md, candidates.csv, each trial's metrics.jsonl).")
    return lines

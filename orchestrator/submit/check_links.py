"""``python -m orchestrator check links OVERRIDES...``: only the link check of a multi-node job, as a short job.

The job is composed and validated exactly as a run (a bad config: one ``error:`` line, exit 2), then submitted
on the same allocation (nodes, tasks per node, partition ...) with ``cluster.link_check.action=only``: its ranks
rendezvous, build megatron's process groups for the layout, measure every cross-node link the layout uses
(:mod:`orchestrator.runtime.faults.links`) and end; no model, data or checkpoint. The job's files go to
``<run.root>/<run.name>-check-links/``. Prints one line per link and one per slow link; exit 0 when no link is
slow, 1 when one is (the ``ib_write_bw`` / nccl-tests step, with the job's own layout and interfaces).
A one-node job has no cross-node link: exit 2.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import List, Optional

from orchestrator.config.slowness import LINKS_ONLY
from orchestrator.errors import ConfigError, OrchestratorError

USAGE = "usage: python -m orchestrator check links [--config-dir DIR] [OVERRIDES...]"


def node_count(cfg) -> int:
    """How many hosts the job's ranks span, as the config asks (cluster=hosts: its host list)."""
    if cfg.cluster.kind == "local":
        return 1
    if cfg.cluster.kind == "hosts":
        from orchestrator.config.hosts import cluster_hosts

        return len(cluster_hosts(cfg.cluster))
    return int(cfg.cluster.nodes)


def check_config(overrides: List[str]):
    """(the check's job config, layout); ConfigError (exit 2) for a bad config or a one-node job."""
    from orchestrator.config.checks import validate
    from orchestrator.config.compose import compose_config
    from orchestrator.config.confdirs import with_config_dir_flags

    cfg = compose_config(with_config_dir_flags(overrides))  # --config-dir DIR: the user's configs, as for a run
    layout = validate(cfg)
    nodes = node_count(cfg)
    if nodes < 2:
        raise ConfigError(
            f"check links: cluster={cfg.cluster.name} with cluster.nodes={cfg.cluster.nodes} runs on one "
            "node, which has no cross-node link to measure; fix: ask for the job's nodes, e.g. "
            "cluster=slurm cluster.nodes=2 (the allocation the training job will get)"
        )
    run = dataclasses.replace(
        cfg.run, name=f"{cfg.run.name}-check-links", dir=f"{cfg.run.root}/{cfg.run.name}-check-links"
    )
    lc = dataclasses.replace(cfg.cluster.link_check, action=LINKS_ONLY)
    return dataclasses.replace(cfg, run=run, cluster=dataclasses.replace(cfg.cluster, link_check=lc)), layout


def main(argv: Optional[List[str]] = None) -> int:
    """Validate, submit the check, print its links; 0 (none slow), 1 (a slow link), 2 (a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv:
        print(f"error: check: which check?; fix: {USAGE[len('usage: ') :]}", file=sys.stderr)
        return 2
    if argv[0] != "links":
        print(
            f"error: check {argv[0]}: no such check; fix: python -m orchestrator check links OVERRIDES", file=sys.stderr
        )
        return 2
    try:
        cfg, layout = check_config(argv[1:])
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    from orchestrator.data.prepare import PreparedData
    from orchestrator.submit.executor import launch

    try:
        summary = launch(cfg, layout, PreparedData([], None, "", ""), show_progress=False)
    except OrchestratorError as exc:  # the job failed: its one line (exit 1)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    record = summary.get("link_check") or {}
    for link in record.get("links", []):
        where = f"{link['src']} -> {link['dst']}" if link["kind"] == "p2p" else ", ".join(link["hosts"])
        print(
            f"  {link['kind']:<9} {where:<24} ranks {link['ranks']}  {link['gbps']:.3g} Gbit/s"
            f"  over {link['interface']}",
            flush=True,
        )
    for line in record.get("slow", []):
        print(f"[orchestrator] {line}", flush=True)
    print(
        f"[orchestrator] link check: {len(record.get('links', []))} link(s) in {record.get('seconds')} s; "
        f"{len(record.get('slow', []))} slow | job {summary.get('job_id')}",
        flush=True,
    )
    return 1 if record.get("slow") else 0

"""Where a job's world size comes from: the cluster section (local tasks, SLURM nodes x tasks, a
hostfile's slots) and the parallel degrees. The rules the world size must meet are in
:mod:`orchestrator.config.layout`.
"""

from __future__ import annotations

from orchestrator.errors import LayoutError


def world_size_of(cfg) -> "tuple[int, str]":
    """World size implied by the cluster config, and a phrase saying where it came from.

    ``cluster.kind=local``: ``cluster.tasks_per_node`` if set, else TP x PP x CP x DP with
    DP = ``parallelism.data_parallel_size`` (1 when null). ``cluster.kind=slurm``:
    ``nodes x tasks_per_node`` (tasks_per_node defaults to ``gpus_per_node``).
    Raises :class:`LayoutError` when the allocation is under-specified.
    """
    p, c = cfg.parallelism, cfg.cluster
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if c.kind == "local":
        if c.nodes != 1:
            raise LayoutError(
                f"cluster.nodes={c.nodes}: cluster=local runs on one machine; fix: cluster.nodes=1 or cluster=slurm"
            )
        if c.tasks_per_node is not None:
            return c.tasks_per_node, f"cluster.tasks_per_node={c.tasks_per_node}"
        dp = p.data_parallel_size or 1
        return mp * dp, f"TP x PP x CP x DP = {mp} x {dp}"
    if c.kind in ("hosts", "torchrun"):
        from orchestrator.config.hosts import nodes_world_size

        return nodes_world_size(c, mp * (p.data_parallel_size or 0))
    tasks = c.tasks_per_node if c.tasks_per_node is not None else c.gpus_per_node
    if not tasks:
        raise LayoutError(
            "cluster.tasks_per_node is null and cluster.gpus_per_node=0, so the number of tasks is unknown; "
            "fix: set cluster.tasks_per_node (CPU jobs) or cluster.gpus_per_node (one task per GPU)"
        )
    return c.nodes * tasks, f"cluster.nodes x cluster.tasks_per_node = {c.nodes} x {tasks}"

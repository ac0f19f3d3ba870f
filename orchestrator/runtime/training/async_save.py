"""Asynchronous checkpoint writes: the one place that knows which queue drives them, by megatron-core version.

``checkpoint.async_save=true``: :func:`orchestrator.runtime.training.checkpoint.save` hands the shards to
``dist_checkpointing.save(..., async_sharded_save=True)`` (megatron's torch_dist strategy stages the
tensors and returns an ``AsyncRequest``); :class:`AsyncSaves` schedules it on an ``AsyncCallsQueue``
(a forked writer process per save, megatron's ``TemporalAsyncCaller``) and training goes on. Every
iteration :meth:`AsyncSaves.poll` asks the queue, without blocking, whether every rank's write is
done (one integer all-reduce, and only while a write is pending, so every rank polls in step);
then the request's finalize functions run on every rank: megatron's own (``.metadata``,
``metadata.json``) and ours (the manifest, retention, the record), in that order.

Version-dependent, so in :func:`orchestrator.runtime.rank.mcore.async_calls_queue_class`: megatron-core
0.19 deprecates its own ``AsyncCallsQueue`` in favour of nvidia-resiliency-ext's (same interface), used
when installed (that path has not run in this project).
"""

from __future__ import annotations

from typing import Any, Optional


class AsyncSaves:
    """At most one asynchronous checkpoint write in flight, finalized on every rank together."""

    def __init__(self) -> None:
        self._queue: Optional[Any] = None

    @property
    def pending(self) -> bool:
        return self._queue is not None and self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, request: Any) -> None:
        """Start writing ``request`` in the background (collective: every rank schedules its own)."""
        if self._queue is None:
            from orchestrator.runtime.rank.mcore import async_calls_queue_class

            self._queue = async_calls_queue_class()(persistent=False)
        self._queue.schedule_async_request(request)

    def poll(self, blocking: bool = False) -> None:
        """Finalize the write if every rank finished it (``blocking``: wait for that). Collective while a
        write is pending; nothing (no collective) otherwise. Raises the writer's error on every rank."""
        if self.pending:
            self._queue.maybe_finalize_async_calls(blocking=blocking)  # type: ignore[union-attr]

    def close(self) -> None:
        """Wait for (and finalize) a pending write, then stop the queue (collective while one is pending)."""
        self.poll(blocking=True)
        if self._queue is not None:
            self._queue.close()
            self._queue = None

"""The stop decision: every rank stops after the same iteration once any rank got a stop signal.

A stop request (:class:`~orchestrator.runtime.faults.preempt.StopRequest`: SIGTERM, SIGUSR1, Ctrl-C,
``orchestrator stop``) reaches the ranks at different moments, so they agree on it in a poll: a SUM/MAX over
every rank of ``[this rank's signal flag, seconds since the previous poll]``. Polls cost no collective of their
own where they can help it:

* on the loop's logging iterations (``training.log_interval``, a save's, a stop's, the last) the poll rides on
  the all-reduce that carries the loss (:class:`~orchestrator.runtime.training.exchange.Exchange`): the
  decision is immediate;
* between them, once :attr:`StopPoll.POLL_S` seconds of iterations have passed since the previous poll, a
  non-blocking MAX all-reduce on a gloo group (a CPU flag: no device sync on a GPU) is started and read at the
  next poll: the stop is agreed one poll after the signal.

The pace is agreed from the polls' own seconds (the slowest rank's, or the ranks' mean where the poll rides on
the loss's SUM): the next asynchronous poll comes ``max(1, POLL_S x iterations / seconds)`` iterations after the
previous poll. With steps of up to ``POLL_S / log_interval`` seconds every poll rides on a logging iteration (no
collective of ours); a job of second-long steps polls every iteration, as Megatron-LM's ``--exit-signal-handler``
checks (a blocking all-gather per iteration there).
"""

from __future__ import annotations

import time
from typing import List

import torch


class StopPoll:
    """The stop decision of ``stop`` (a StopRequest). Collective: every rank calls :meth:`requested` or
    :meth:`merged` every iteration, the same one on the same iterations."""

    POLL_S = 5.0
    """Seconds of training between asynchronous polls. Where logging iterations are further apart than this, a
    stop is agreed within about twice this after its signal (plus a step: a signal just after a poll was sent
    rides on the next one, read at the one after; measured 4.4-8.9 s), well inside the warning SLURM gives
    before a time limit or preemption (``--signal``, 90 s here); otherwise at the first logging iteration after
    the rank sees the request (a signal to a local launcher reaches the ranks as a stop file, read once a second:
    with fast steps that is one or two logging iterations after the signal). With
    the shipped ``training.log_interval`` (10), steps of up to 0.5 s poll only on logging iterations."""

    def __init__(self, stop):
        self.stop = stop
        self.group = torch.distributed.new_group(backend="gloo")
        self._sent = torch.zeros(2, dtype=torch.float64)
        self._work = None
        self._sent_iters = 1
        self.every, self._iters, self._last = 1, 0, time.perf_counter()

    def share(self) -> List[float]:
        """This rank's part of a poll: ``[signal flag (0/1), seconds since the previous poll]``."""
        return [float(self.stop.local_flag), time.perf_counter() - self._last]

    def requested(self) -> bool:
        """An iteration without a logging all-reduce: True on every rank when any rank had received a signal by
        the previous asynchronous poll (read here, once the next is due)."""
        self._iters += 1
        if self._iters < self.every:
            return False
        decided = self._collect()
        self._sent, self._sent_iters = torch.tensor(self.share(), dtype=torch.float64), self._iters
        self._restart()
        self._work = torch.distributed.all_reduce(
            self._sent, op=torch.distributed.ReduceOp.MAX, group=self.group, async_op=True
        )
        return self._decide(decided)

    def merged(self, flags: float, mean_seconds: float) -> bool:
        """An iteration whose logging all-reduce carried :meth:`share` (summed over ranks): ``flags``, how many
        ranks had a signal; ``mean_seconds``, their mean seconds since the previous poll. True on every rank
        when any rank had one (an asynchronous poll still in flight is read too, so none is left behind)."""
        self._iters += 1
        decided = self._collect() or flags > 0
        self._pace(mean_seconds, self._iters)
        self._restart()
        return self._decide(decided)

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def _collect(self) -> bool:
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        flag, seconds = self._sent.tolist()
        self._pace(seconds, self._sent_iters)
        return flag > 0

    def _pace(self, seconds: float, iterations: int) -> None:
        self.every = max(1, int(self.POLL_S * iterations // max(seconds, 1e-9)))

    def _restart(self) -> None:
        self._iters, self._last = 0, time.perf_counter()

    def _decide(self, decided: bool) -> bool:
        if decided and not self.stop.local_flag:
            self.stop.trigger("peer")  # another rank got the signal; requeue_or_exit names it
        return decided

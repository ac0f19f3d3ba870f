"""The measured pipeline schedule: ``training.trace_iteration=N`` records, on every rank, when each
micro-batch's forward and backward ran in iteration N, and the point-to-point waits between them.

Off (the default) nothing here runs: the loop passes its own forward step to megatron. On, and only for
iteration N (collective: every rank traces the same iteration):

* the ranks meet at a barrier of their own gloo group and each takes its ``time.perf_counter()`` there
  as zero: one clock for all ranks (aligned to the barrier's release, microseconds on one host);
* the forward step megatron is given is wrapped: start and end of every call, the model chunk (which of
  the rank's chunks megatron passed) and the micro-batch (the id megatron sets on the chunk's layers,
  ``set_current_microbatch``); a gradient hook on its output names the micro-batch whose backward
  reaches it;
* megatron's ``backward_step`` and :class:`P2PCommunicator`'s send/recv methods are wrapped (module and
  class attributes swapped in for the iteration and restored after it): start and end of each;
* on a GPU every clock reading first synchronizes the device (kernels run asynchronously), so the traced
  iteration runs without CPU/GPU overlap: its times are the steps' own, its total a little longer.

* with the distributed optimizer's overlapped parameter all-gather, megatron's bucket groups'
  ``start_param_sync`` is wrapped too: every dispatch of a chunk's all-gather is a ``param-gather`` event
  (its chunk, when it was dispatched), whoever dispatched it: the schedule's prefetch through
  ``config.param_sync_func`` (:mod:`orchestrator.runtime.rank.param_sync`) or, when nothing prefetched it,
  the chunk's own forward pre-hook at its first forward (the gather is then exposed).

Then every rank's events are gathered; the logging rank writes ``<run.dir>/schedule.json`` (the
events, the measured and predicted schedules, the bubble per stage), ``<run.dir>/schedule_trace.json``
(Chrome trace events: chrome://tracing, https://ui.perfetto.dev) and ``<run.dir>/schedule.png``
(measured beside predicted, :mod:`orchestrator.plan.picture`), and the measured bubble goes into the
job's summary next to (p-1)/(v m).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Dict, List, Optional

import torch

from orchestrator.plan.pipeline_schedule import (
    BACKWARD,
    FORWARD,
    Schedule,
    measured_costs,
    measured_schedule,
    predict_measured,
)

SCHEDULE_FILE, CHROME_FILE, PICTURE_FILE = "schedule.json", "schedule_trace.json", "schedule.png"
PARAM_GATHER = "param-gather"
"""The event kind of one dispatch of a chunk's parameter all-gather (distributed optimizer, overlapped)."""
_P2P = (
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
)


class Tracer:
    """Records one iteration of one rank (see the module docstring); build it on every rank."""

    def __init__(self, rank, iteration: int):
        from megatron.core import parallel_state as ps

        self.rank, self.iteration = rank, iteration
        self.group = torch.distributed.new_group(backend="gloo")  # collective: every rank builds one
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.events: List[Dict[str, object]] = []
        self._zero = 0.0
        self._pending: List[tuple] = []  # (micro-batch, chunk) whose output gradient has arrived
        self.result: Optional[Dict[str, object]] = None
        self._cuda = rank.device == "cuda"

    def _now(self) -> float:
        if self._cuda:  # kernels run asynchronously: a step ends when the device has done its work
            torch.cuda.synchronize()
        return time.perf_counter() - self._zero

    def _event(self, kind: str, start: float, end: float, microbatch: int = -1, chunk: int = -1) -> None:
        self.events.append({"kind": kind, "start": start, "end": end, "microbatch": microbatch, "chunk": chunk})

    def _forward(self, forward_step):
        chunks = {id(c): i for i, c in enumerate(self.rank.built.model)}
        counts: Dict[int, int] = {}

        def traced(data_iterator, model):
            chunk = chunks.get(id(model), 0)
            layers = getattr(getattr(_inner(model), "decoder", None), "layers", None)
            mb = getattr(layers[0], "current_microbatch", None) if layers else None
            mb = counts.get(chunk, 0) if mb is None else int(mb)  # no layer on the chunk: megatron's count
            counts[chunk] = counts.get(chunk, 0) + 1
            start = self._now()
            output, loss_func = forward_step(data_iterator, model)
            self._event(FORWARD, start, self._now(), mb, chunk)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._pending.append((mb, chunk)))
            return output, loss_func

        return traced

    def _backward(self, backward_step):
        def traced(*args, **kwargs):
            start, seen = self._now(), len(self._pending)
            out = backward_step(*args, **kwargs)
            mb, chunk = self._pending[seen] if len(self._pending) > seen else (-1, -1)
            self._event(BACKWARD, start, self._now(), mb, chunk)
            return out

        return traced

    def _p2p(self, name: str, method):
        def traced(*args, **kwargs):
            start = self._now()
            out = method(*args, **kwargs)
            self._event(name, start, self._now())
            return out

        return traced

    def _param_gather(self, start_param_sync):
        """megatron's bucket-group ``start_param_sync``, recording each dispatch as a ``param-gather`` event of
        the chunk whose bucket group it is (a forced synchronous gather is not a dispatch and is not recorded)."""
        owners = {id(g): i for i, c in enumerate(self.rank.built.model) for g in getattr(c, "bucket_groups", ())}

        def traced(group, force_sync: bool = False):
            start = self._now()
            out = start_param_sync(group, force_sync=force_sync)
            if not force_sync:
                self._event(PARAM_GATHER, start, self._now(), chunk=owners.get(id(group), -1))
            return out

        return traced

    @contextlib.contextmanager
    def recording(self, forward_step):
        """Around one ``forward_backward`` call: yields the forward step to pass to megatron."""
        from megatron.core.distributed import param_and_grad_buffer as buffers
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        torch.distributed.barrier(group=self.group)
        self._zero = time.perf_counter()
        groups = buffers._ParamAndGradBucketGroup  # megatron-core's bucket group (0.16 and 0.19)
        saved = [(schedules, "backward_step", schedules.backward_step)]
        saved += [(p2p_communication.P2PCommunicator, n, getattr(p2p_communication.P2PCommunicator, n)) for n in _P2P]
        saved += [(groups, "start_param_sync", groups.start_param_sync)]
        schedules.backward_step = self._backward(schedules.backward_step)
        for name in _P2P:
            setattr(p2p_communication.P2PCommunicator, name, self._p2p(name, saved[1 + _P2P.index(name)][2]))
        groups.start_param_sync = self._param_gather(saved[-1][2])
        start = self._now()
        try:
            yield self._forward(forward_step)
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)
        self._event("iteration", start, self._now())
        self._finish()

    def _finish(self) -> None:
        """Gather every rank's events (collective); the logging rank writes the files."""
        mine = {
            "rank": self.rank.info.rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "events": self.events,
        }
        everyone: List[Optional[dict]] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(everyone, mine, group=self.group)
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        lay = self.rank.layout  # the traced iteration's micro-batches: megatron-core's calculator (a ramp's)
        measured = measured_schedule(everyone, lay.pipeline_model_parallel_size, lay.vpp, get_num_microbatches())
        self.result = bubble_record(measured, self.iteration)
        if self.rank.is_logger:
            write(self.rank.cfg.run.dir, everyone, measured, self.result)
        for line in describe(measured, self.iteration) + describe_param_gathers(everyone):
            self.rank.say(line)


def _inner(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def bubble_record(measured: Schedule, iteration: int) -> Dict[str, object]:
    """The measured bubble per stage next to the formula and to the schedule predicted from the iteration's
    own measured operations (:func:`~orchestrator.plan.pipeline_schedule.predict_measured`): the summary's
    ``schedule_trace``."""
    overhead, fraction = measured.formula()
    ops = predict_measured(measured)
    return {
        "iteration": iteration,
        "schedule": measured.name,
        "pp": measured.pp,
        "vpp": measured.vpp,
        "num_microbatches": measured.num_microbatches,
        "iteration_s": measured.window[1] - measured.window[0],
        "measured_bubble_overhead": measured.bubble_overhead(),
        "measured_idle_share": measured.idle_share(),
        "predicted_bubble_overhead": overhead,
        "predicted_idle_share": fraction,
        "ops_bubble_overhead": ops.bubble_overhead(),
        "ops_iteration_s": ops.window[1] - ops.window[0],
        "ops": measured_costs(measured),
    }


def describe(measured: Schedule, iteration: int) -> List[str]:
    """Lines: the measured bubble per stage next to (p-1)/(v m) and (p-1)/(v m + p-1)."""
    p, v, m = measured.pp, measured.vpp, measured.num_microbatches
    overhead, fraction = measured.formula()
    lines = [
        f"schedule of iteration {iteration} ({measured.name}, PP{p}, m={m}, v={v}; "
        f"{1e3 * (measured.window[1] - measured.window[0]):.1f} ms), measured bubble per stage vs "
        f"(p-1)/(v m) = {p - 1}/({v} x {m}) = {overhead:.1%} and idle share (p-1)/(v m + p-1) = {fraction:.1%}:"
    ]
    ops = predict_measured(measured).bubble_overhead()
    lines += [
        f"  stage {r}: idle/busy {o:.1%} vs {overhead:.1%} (predicted from the measured operations: {q:.1%}); "
        f"idle share {i:.1%} vs {fraction:.1%}"
        for r, (o, i, q) in enumerate(zip(measured.bubble_overhead(), measured.idle_share(), ops))
    ]
    return lines


def prefetched_chunks(events: List[Dict[str, object]]) -> Dict[int, bool]:
    """Per model chunk with a ``param-gather`` event among one rank's ``events``: True when its first dispatch
    came before the chunk's first forward started (prefetched by the schedule), False when it came inside it
    (the forward pre-hook dispatched it: the gather was exposed)."""
    first_forward: Dict[int, float] = {}
    for e in events:
        if e["kind"] == FORWARD:
            first_forward[e["chunk"]] = min(first_forward.get(e["chunk"], e["start"]), e["start"])  # type: ignore
    out: Dict[int, bool] = {}
    for e in sorted((e for e in events if e["kind"] == PARAM_GATHER), key=lambda e: e["start"]):  # type: ignore
        chunk = int(e["chunk"])  # type: ignore[arg-type]
        if chunk not in out and chunk in first_forward:
            out[chunk] = float(e["start"]) < first_forward[chunk]  # type: ignore[arg-type]
    return out


def describe_param_gathers(ranks: List[dict]) -> List[str]:
    """One line when the traced iteration dispatched parameter all-gathers: on how many ranks every chunk's
    gather was dispatched ahead of its first forward; none otherwise."""
    per_rank = {r["rank"]: prefetched_chunks(r["events"]) for r in ranks}
    per_rank = {k: v for k, v in per_rank.items() if v}
    if not per_rank:
        return []
    exposed = sorted(k for k, v in per_rank.items() if not all(v.values()))
    verdict = f"exposed at a chunk's first forward on rank(s) {exposed}" if exposed else "none exposed"
    ahead = len(per_rank) - len(exposed)
    return [
        f"  parameter all-gather: every chunk's dispatched ahead of its first forward on {ahead} of {len(per_rank)} ranks; {verdict}"
    ]


def _chrome(ranks: List[dict]) -> Dict[str, object]:
    events: List[Dict[str, object]] = []
    for r in ranks:
        pid = r["rank"]
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"rank {r['rank']} (pp {r['pp_rank']}, dp {r['dp_rank']}, tp {r['tp_rank']})"},
            }
        )
        for e in r["events"]:
            name = (
                f"{e['kind']} mb {e['microbatch']} chunk {e['chunk']}"
                if e["kind"] in (FORWARD, BACKWARD)
                else str(e["kind"])
            )
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": pid,
                    "tid": 0 if e["kind"] != "iteration" else 1,
                    "ts": 1e6 * float(e["start"]),
                    "dur": 1e6 * (float(e["end"]) - float(e["start"])),
                    "cat": "compute" if e["kind"] in (FORWARD, BACKWARD) else "pipeline",
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(run_dir: str, ranks: List[dict], measured: Schedule, result: Dict[str, object]) -> None:
    """schedule.json, schedule_trace.json and schedule.png in ``run_dir``."""
    from orchestrator.io import write_atomic
    from orchestrator.plan import picture

    predicted = predict_measured(measured)
    doc = {
        "bubble": result,
        "ranks": ranks,
        "predicted": [vars(s) for s in predicted.steps],
        "measured": [vars(s) for s in measured.steps],
    }
    write_atomic(os.path.join(run_dir, SCHEDULE_FILE), json.dumps(doc))
    write_atomic(os.path.join(run_dir, CHROME_FILE), json.dumps(_chrome(ranks)))
    picture.draw_schedules(
        os.path.join(run_dir, PICTURE_FILE),
        [predicted, measured],
        [f"predicted ({measured.name}, from the measured operations)", f"measured, iteration {result['iteration']}"],
    )


def tracer_for(rank) -> Optional[Tracer]:
    """A :class:`Tracer` when ``training.trace_iteration`` is set, else None (collective when set)."""
    n = rank.cfg.training.trace_iteration
    return Tracer(rank, n) if n else None


def around(tracer: Optional[Tracer], iteration: int, forward_step):
    """The context for iteration ``iteration``'s ``forward_backward``: yields the forward step to pass."""
    if tracer is None or iteration != tracer.iteration:
        return contextlib.nullcontext(forward_step)
    return tracer.recording(forward_step)

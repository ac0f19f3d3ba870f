"""The single-run pipeline: one composed config -> validate -> plan -> preflight -> data -> launch.

:func:`run` is what ``python -m orchestrator`` does for one config (steps 2-6 of
:mod:`orchestrator.__main__`), what every sweep point runs and what each ``tune`` trial runs; the
entry point keeps the error boundary, composition and the sub-tools. ``launcher`` chooses how the job
runs: a fresh submitit job (:func:`orchestrator.submit.executor.launch`, the default) or warm ranks
(:class:`orchestrator.submit.pool_launcher.PoolLauncher`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Callable, Optional

from orchestrator.ckpt.space import check_writable
from orchestrator.config.checks import validate, validate_planned
from orchestrator.config.hf_config import hf_path
from orchestrator.config.layout import ParallelLayout, vpp_no_op
from orchestrator.config.ramp import describe as describe_ramp
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError, ResumeMismatchError


def goodput_forecast(cfg: JobConfig, step_s: float):
    """The plan's goodput forecast (plan.goodput) for ``cfg``'s nodes, its predicted step time ``step_s`` (s),
    its checkpoint's predicted bytes at the stated write bandwidth, and how it restarts."""
    from orchestrator.plan.ckpt_size import checkpoint_bytes
    from orchestrator.plan.goodput import checkpoint_seconds, forecast

    nodes = max(1, int(cfg.cluster.nodes or 1))
    io_s = checkpoint_seconds(checkpoint_bytes(cfg), nodes)
    c = cfg.checkpoint
    auto = c.save_interval == "auto"
    return forecast(
        nodes=nodes,
        step_s=step_s,
        save_s=io_s,
        load_s=io_s,
        interval_iters=cfg.training.train_iters if auto else int(c.save_interval or cfg.training.train_iters),
        in_place=bool(cfg.cluster.max_restarts),
        mtbf_hours=cfg.cluster.mtbf_hours,
        auto=(c.auto_min_interval, c.auto_max_interval) if auto else None,
    )


def goodput_line(run_dir) -> str:
    """The run's goodput over all its attempts (``status --goodput`` has the whole account), said at the job's
    end."""
    from orchestrator.ckpt.goodput import account
    from orchestrator.ckpt.goodput_report import one_line

    acc = account(run_dir)
    return one_line(acc) if acc is not None else "goodput: no records"


def say(message: str) -> None:
    print("\n".join(f"[orchestrator] {line}" for line in message.splitlines()), flush=True)


class Current:
    """The config of the run in progress, for the interrupt message."""

    cfg: Optional[JobConfig] = None


def show_plan(cfg: JobConfig) -> None:
    from orchestrator.plan import memory as planner
    from orchestrator.plan import suggest
    from orchestrator.plan.report import format_plan

    plan = planner.plan(cfg)
    print(format_plan(plan), flush=True)
    if cfg.plan_picture:  # nothing is drawn unless asked
        from orchestrator.plan import picture
        from orchestrator.plan.pipeline_schedule import predict_for_plan

        picture.draw_plan(cfg.plan_picture, plan, predict_for_plan(plan))
        say(f"wrote {cfg.plan_picture}: the predicted schedule and the memory per stage")
    print("\n".join(goodput_forecast(cfg, plan.step_time_s).lines()), flush=True)
    suggestions = suggest.suggest(cfg)
    if suggestions:
        print(suggest.format_suggestions(suggestions), flush=True)


def check_passthrough(cfg: JobConfig, layout: ParallelLayout) -> None:
    """``model/parallelism/optimizer.megatron``: a field the installed megatron-core lacks, or one a schema key owns,
    is one ConfigError line before anything is written or queued (megatron-core is imported only when they are
    used). :mod:`orchestrator.config.megatron_passthrough`."""
    from orchestrator.config.megatron_passthrough import passthrough

    if not any(passthrough(cfg).values()):
        return
    from orchestrator.runtime.rank.megatron_config import check_buildable

    check_buildable(cfg, layout.data_parallel_size)  # names, schema-owned fields, then megatron-core's own checks


def dry_run(cfg: JobConfig, layout: ParallelLayout) -> None:
    if cfg.cluster.kind == "slurm":
        from orchestrator.submit.sbatch import render_sbatch

        print(render_sbatch(cfg, layout.world_size, f"{cfg.run.dir}/submitit"), flush=True)
    elif cfg.cluster.kind in ("hosts", "torchrun"):
        from orchestrator.submit.platform import describe

        say(describe(cfg, layout))
    else:
        say(f"would start {layout.world_size} local processes (submitit LocalExecutor) in {cfg.run.dir}")


def prepare_data(cfg: JobConfig, indices: bool = True):
    """Tokenize/index the data and (``indices``) build GPTDataset's sample indices once, before any rank
    starts. Warm ranks and a local job's one task build missing indices themselves (their megatron-core is
    imported already: :mod:`orchestrator.runtime.start.pool`, :func:`orchestrator.submit.executor.one_task`);
    the launcher would pay the import, seconds, for it."""
    from orchestrator.data.prepare import indices_cached, prepare
    from orchestrator.meter import phase
    from orchestrator.runtime.rank.dataset import cache_indices

    with phase(f"preparing data (data={cfg.data.name})"):
        prepared = prepare(cfg.data)
    if indices and not indices_cached(cfg, prepared):  # a warm cache: no torch/megatron import in the launcher
        with phase("building sample indices (megatron-core GPTDataset; imports torch and megatron-core)"):
            cache_indices(cfg, prepared)
    return prepared


def record_config(cfg: JobConfig) -> None:
    """``<run.dir>/config.yaml``: the resolved config of the run that starts now, and the command."""
    import yaml

    from orchestrator.ckpt.rundir import CONFIG_FILE
    from orchestrator.config.schema import to_dict
    from orchestrator.io import write_atomic

    header = (
        f"# the resolved config of the run started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"# command: python -m orchestrator {shlex.join(sys.argv[1:])}\n"
    )
    write_atomic(os.path.join(cfg.run.dir, CONFIG_FILE), header + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _has_checkpoints(cfg: JobConfig) -> bool:
    from orchestrator.ckpt.manifest import save_dir_of

    save_dir = save_dir_of(cfg)
    return save_dir.is_dir() and any(p.is_dir() for p in save_dir.iterdir())


def check_hf_source(cfg: JobConfig, path: str) -> None:
    """``checkpoint.init_from=hf:PATH`` before queueing: a readable directory of a supported architecture whose
    shards are all there, and a model whose keys build its weights' shapes with the job's vocabulary; ConfigError
    (one line naming the keys, ours and config.json's) otherwise."""
    import importlib.util

    from orchestrator.ckpt.hf_dir import HfCheckpointError, weight_map
    from orchestrator.config.hf_config import HfConfigError, read_config, shape_problems
    from orchestrator.config.layout import padded_vocab_size
    from orchestrator.plan.inputs import vocab_size_of

    key = f"checkpoint.init_from=hf:{path}"
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"{key}: reading safetensors needs the hf extra; fix: pip install 'orchestrator[hf]'")
    try:
        config = read_config(path)
        problems = shape_problems(config, cfg.model)
        weight_map(path)
    except (HfConfigError, HfCheckpointError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    vocab, _ = vocab_size_of(cfg)
    if vocab != config["vocab_size"]:
        problems.append(
            f"vocabulary: the job's {vocab} (data.tokenizer={cfg.data.tokenizer}), config.json {config['vocab_size']} "
            "(data.tokenizer=<the model directory> or data.vocab_size)"
        )
    if problems:
        raise ConfigError(
            f"{key}: the model does not build these weights: {'; '.join(problems)}; fix: the experiment "
            f"`python -m orchestrator convert from-hf {path}` writes"
        )
    m, tp = cfg.model, cfg.parallelism.tensor_model_parallel_size
    padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp)
    if padded != vocab:  # megatron's loss is a softmax over every row; transformers' over the vocabulary
        fix = "1 (convert from-hf's)" if vocab % tp == 0 else f"1 and a tensor_model_parallel_size dividing {vocab}"
        say(
            f"warning: model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} x TP {tp} pads the "
            f"vocabulary {vocab} -> {padded}: the padded logits enter the loss, which is then not transformers' on "
            f"these weights; fix: model.make_vocab_size_divisible_by={fix}"
        )


def preflight(cfg: JobConfig, layout: ParallelLayout):
    """The resume check before anything is prepared or queued, the same for a run and its plan or dry
    run; writes nothing. Returns the checkpoint the run resumes from (None: it starts fresh); raises
    ResumeMismatchError (with the diff table), ManifestError or RunLockedError (a live run holds the
    directory) when the run would be refused."""
    from orchestrator.ckpt import resume
    from orchestrator.ckpt.lock import RunLock
    from orchestrator.data.prepare import data_fingerprint
    from orchestrator.data.tokenizer import tokenizer_identity

    held = _has_checkpoints(cfg)  # nothing to compare with otherwise (a plan's data may live elsewhere)
    hf = hf_path(cfg.checkpoint.init_from)
    if hf is not None and not held:  # a resume needs nothing from the source directory
        check_hf_source(cfg, hf)
    elif hf is None and cfg.checkpoint.init_from:
        from orchestrator.ckpt.manifest import read_manifest

        refusal = resume.init_from_refusal(read_manifest(cfg.checkpoint.init_from), cfg, layout)  # ManifestError
        if refusal:  # naming the file, or weights of another shape: before anything starts
            raise ResumeMismatchError(refusal)
    fingerprint = data_fingerprint(cfg.data) if held else None  # hashes, never tokenizes
    latest = resume.preflight(
        cfg,
        layout,
        data_fingerprint=fingerprint,
        tokenizer=tokenizer_identity(cfg.data) if held else None,
        warn=lambda m: say(f"warning: {m}"),
    )
    RunLock(cfg.run.dir).probe()  # a live holder: refuse now; the job's rank 0 takes the lock itself
    return latest


def finished(cfg: JobConfig, latest) -> bool:
    """Whether the checkpoint the run would resume from (``latest``, None: none) is already at
    ``training.train_iters``: the run then starts nothing, and its dry run submits nothing either."""
    return latest is not None and latest.iteration >= cfg.training.train_iters


def verdict(cfg: JobConfig, latest, *, dry: bool) -> str:
    """What the preflight decided, in one line (``dry``: as a plan or dry run says it)."""
    if finished(cfg, latest):
        return (
            f"{latest.path} is already at iteration {latest.iteration} >= training.train_iters="
            f"{cfg.training.train_iters}: nothing to train (raise training.train_iters to continue)"
        )
    if latest is not None:
        return f"{'would' if dry else 'will'} resume from {latest.path} (iteration {latest.iteration})"
    from orchestrator.ckpt.manifest import save_dir_of

    return f"{'would start' if dry else 'starts'} fresh: no checkpoint in {save_dir_of(cfg)}"


def _check_space(cfg: JobConfig) -> None:
    """ConfigError (one line) when the run's filesystem cannot hold the checkpoints it keeps at once."""
    from orchestrator.ckpt.space import space_refusal
    from orchestrator.plan.ckpt_size import checkpoint_bytes, checkpoint_params, held_at_peak

    refusal = space_refusal(cfg, checkpoint_bytes(cfg), held_at_peak(cfg), checkpoint_params(cfg))
    if refusal:
        raise ConfigError(refusal)


def run(cfg: JobConfig, launcher: Optional[Callable[..., dict]] = None) -> Optional[dict]:
    """The whole pipeline for one composed config; returns the job summary (None for plan/dry-run).

    ``launcher``: what submits and waits, ``(cfg, layout, prepared) -> summary``; default
    :func:`orchestrator.submit.executor.launch` (a fresh job); sweeps and tune pass a
    :class:`~orchestrator.submit.pool_launcher.PoolLauncher` (warm ranks)."""
    from orchestrator.plan.inputs import gpu_preset

    Current.cfg = cfg
    if cfg.plan and not cfg.dry_run:  # a plan describes the job: data files not here are a warning
        layout, warnings = validate_planned(cfg)
        for warning in warnings:
            say(f"warning: {warning}")
    else:
        layout = validate(cfg)
    if cfg.gpu is not None:
        gpu_preset(cfg.gpu)  # the planner's presets: ConfigError naming gpu=
    check_passthrough(cfg, layout)
    if not cfg.plan:  # one line before the plan's lines
        check_writable(cfg.run.root, cfg.run.dir)
        _check_space(cfg)
    say(f"run {cfg.run.name}: {cfg.model.name} x {cfg.parallelism.name} on cluster={cfg.cluster.name}")
    say(layout.summary())
    if cfg.training.rampup_batch_size is not None:
        say(describe_ramp(cfg.training, layout.data_parallel_size))
    if vpp_no_op(cfg) and not (cfg.plan or cfg.dry_run):  # the plan says it among its notes
        say(f"note: {vpp_no_op(cfg)}")
    if cfg.plan or cfg.dry_run:
        show_plan(cfg)
        latest = preflight(cfg, layout)  # a refusal: exit 2 with its table, as the run's
        say(verdict(cfg, latest, dry=True))
        if cfg.dry_run and not finished(cfg, latest):  # the run would end at "nothing to train" too
            dry_run(cfg, layout)
        return None

    from orchestrator.ckpt.lock import RunLock
    from orchestrator.submit.executor import launch, one_task
    from orchestrator.submit.signals import raise_if_interrupted

    latest = preflight(cfg, layout)
    if cfg.cluster.kind == "slurm":  # a partition that cannot hold the job: one line, before the data
        from orchestrator.submit.partition import check_partition

        check_partition(cfg)
    if cfg.cluster.kind in ("hosts", "torchrun"):  # SSH to every host / the platform's variables: one line if not
        from orchestrator.submit.platform import check_nodes

        say(check_nodes(cfg))
    if latest is not None:
        say(verdict(cfg, latest, dry=False))
    if finished(cfg, latest):
        return {"status": "already_done", "iteration": latest.iteration}
    prepared = prepare_data(cfg, indices=launcher is None and not one_task(cfg, layout.world_size))
    raise_if_interrupted()  # a signal lost while the data were prepared: nothing is recorded or submitted
    RunLock(cfg.run.dir).probe()  # again: a job submitted to run.dir while the data were prepared
    record_config(cfg)
    summary = (launcher or launch)(cfg, layout, prepared)
    if summary.get("status") in ("completed", "exited", "stopped"):
        step = summary.get("step_time_median_s")
        loss = summary.get("lm_loss")  # None on a node of cluster=torchrun without the logging rank
        if (summary.get("breakdown") or {}).get("stages"):  # before the result line, which stays the last
            from orchestrator.plan.step_breakdown import describe

            say(describe(summary["breakdown"], f"over {summary.get('timed_iterations')} timed iterations"))
        say(goodput_line(cfg.run.dir))
        say(
            f"{summary['status']}: iteration {summary.get('iteration')}"
            + (f" | lm loss {loss:.4f}" if loss is not None else "")
            + (f" | median step {step * 1000:.1f} ms | {layout.tokens_per_step / step:.0f} tokens/s" if step else "")
            + f" | job {summary.get('job_id')}"
        )
    return summary

"""Manifest, resume comparison, preflight and run lock — with real files and processes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.ckpt.catalogue import latest_complete, list_checkpoints
from orchestrator.ckpt.compare import compare
from orchestrator.ckpt.lock import RunLock
from orchestrator.ckpt.manifest import (
    MANIFEST_NAME,
    SCHEMA,
    build_manifest,
    iteration_dir,
    read_manifest,
    save_dir_of,
    write_manifest,
)
from orchestrator.ckpt.mismatch import blocking, format_mismatch_table
from orchestrator.ckpt.resume import origin_of, preflight
from orchestrator.config.layout import layout_from_config, padded_vocab_size
from orchestrator.config.schema import DataConfig, JobConfig, from_dict
from orchestrator.data.prepare import PreparedData
from orchestrator.data.tokenizer import tokenizer_identity
from orchestrator.errors import ManifestError, ResumeMismatchError, RunLockedError

REPO = Path(__file__).resolve().parent.parent
BYTE_ID = tokenizer_identity(DataConfig(tokenizer="byte"))
"""What the runtime records for the byte tokenizer (test_data checks it against megatron's tokenizer)."""
BYTE_VOCAB = BYTE_ID["vocab_size"]  # 258: 256 byte ids + <eod> + <pad>


def pp2_dp2(run_dir: Path) -> JobConfig:
    """The gpt_pp2_dp2 experiment as a typed config (4 local ranks: TP 1 x PP 2 x DP 2)."""
    cfg = JobConfig()
    cfg.parallelism = dataclasses.replace(
        cfg.parallelism, name="pp2_dp2", pipeline_model_parallel_size=2, data_parallel_size=2
    )
    cfg.run = dataclasses.replace(cfg.run, dir=str(run_dir), name="gpt_pp2_dp2")
    cfg.data = dataclasses.replace(cfg.data, cache_dir=str(run_dir / "cache"))
    return cfg


def changed(cfg: JobConfig, **sections) -> JobConfig:
    """A copy of cfg with e.g. parallelism={"tensor_model_parallel_size": 2}."""
    out = dataclasses.replace(cfg)
    for name, values in sections.items():
        setattr(out, name, dataclasses.replace(getattr(cfg, name), **values))
    return out


def save_checkpoint(
    cfg: JobConfig,
    iteration: int,
    *,
    manifest: bool = True,
    digest: str = "sha256",
    fingerprint: str = "fp-1",
    tokenizer: dict | None = None,
) -> Path:
    """What the runtime does (runtime/training/run.py write_manifest): dist_checkpointing files first, then the
    manifest with the tokenizer identity, the data identity and the versions it records."""
    layout = layout_from_config(cfg).validate()
    path = iteration_dir(save_dir_of(cfg), iteration)
    path.mkdir(parents=True)
    for rank in range(layout.world_size):
        (path / f"__{rank}_0.distcp").write_bytes(os.urandom(256) + bytes([rank]) * iteration)
    (path / ".metadata").write_bytes(b"metadata" * 10)
    (path / "common.pt").write_bytes(b"common-state")
    if manifest:
        m = build_manifest(
            cfg,
            layout,
            iteration=iteration,
            consumed_samples=iteration * 16,
            checkpoint_dir=str(path),
            vocab_size=BYTE_VOCAB,
            padded_vocab_size=padded_vocab_size(
                BYTE_VOCAB, cfg.model.make_vocab_size_divisible_by, layout.tensor_model_parallel_size
            ),
            tokenizer=tokenizer or BYTE_ID,
            data=PreparedData([], None, fingerprint, str(cfg.data.cache_dir)).identity(cfg.data),
            digest=digest,
        )
        write_manifest(path, m)
    return path


@pytest.fixture
def cfg(tmp_path: Path) -> JobConfig:
    return pp2_dp2(tmp_path / "run")


# ---- manifest content, atomic write ------------------------------------------------------
@pytest.mark.mcore_lines
def test_manifest_records_layout_config_versions_and_env(cfg, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_IB_SECRET_TOKEN", "hunter2")
    path = save_checkpoint(cfg, 50)
    m = read_manifest(path)
    assert m["schema"] == SCHEMA and m["iteration"] == 50 and m["consumed_samples"] == 800
    assert m["layout"]["pipeline_model_parallel_size"] == 2 and m["layout"]["data_parallel_size"] == 2
    assert m["layout"]["world_size"] == 4 and m["layout"]["layers_per_stage"] == 2
    assert m["batch"] == {
        "micro_batch_size": 4,
        "global_batch_size": 16,
        "num_microbatches": 2,
        "rampup_batch_size": None,
    }
    assert m["model"]["vocab_size"] == 258 and m["model"]["padded_vocab_size"] == 384
    assert m["tokenizer"] == {"spec": "byte", **BYTE_ID} and m["data"]["fingerprint"] == "fp-1"
    assert m["checkpoint"]["format"] == "torch_dist" and m["checkpoint"]["distributed_optimizer"] is False
    assert set(m["versions"]) >= {"orchestrator", "megatron-core", "torch", "python"}
    assert m["env"]["NCCL_DEBUG"] == "INFO" and "NCCL_IB_SECRET_TOKEN" not in m["env"]
    assert m["files"]["count"] == 6 and MANIFEST_NAME not in [e["path"] for e in m["files"]["entries"]]
    assert from_dict(m["config"]) == cfg


def test_write_is_atomic_and_a_failed_write_leaves_the_old_manifest(cfg):
    path = save_checkpoint(cfg, 50)
    before = (path / MANIFEST_NAME).read_bytes()
    broken = dict(read_manifest(path), zz_unserializable=object())  # json.dump fails part-way through
    with pytest.raises(TypeError):
        write_manifest(path, broken)
    assert (path / MANIFEST_NAME).read_bytes() == before
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".manifest")) == []
    read_manifest(path)


# ---- bad manifests ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage, phrase",
    [
        (lambda text: text[: len(text) // 2], "truncated"),
        (lambda text: "", "empty"),
        (lambda text: text.replace('"iteration": 50', '"iteration": 60'), "hand-edited"),
        (lambda text: json.dumps({"schema": "someone.else/3"}), "foreign"),
        (lambda text: "[1, 2]", "foreign"),
    ],
)
def test_damaged_manifest_errors_name_the_file(cfg, damage, phrase):
    path = save_checkpoint(cfg, 50)
    f = path / MANIFEST_NAME
    f.write_text(damage(f.read_text()))
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    assert str(f) in str(err.value) and phrase in str(err.value)
    (info,) = list_checkpoints(save_dir_of(cfg))
    assert info.status == "corrupt" and str(f) in info.reason


def test_missing_manifest_is_a_torn_checkpoint(cfg):
    path = save_checkpoint(cfg, 50, manifest=False)
    with pytest.raises(ManifestError, match="torn"):
        read_manifest(path)
    assert [(i.iteration, i.status) for i in list_checkpoints(save_dir_of(cfg))] == [(50, "torn")]


# ---- digest ----------------------------------------------------------------------------------
def test_digest_mismatch_names_changed_missing_and_unexpected_files(cfg):
    path = save_checkpoint(cfg, 50)
    shard = path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    (path / "common.pt").unlink()
    (path / "stray.bin").write_bytes(b"x")
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    msg = str(err.value)
    assert "changed __1_0.distcp (content)" in msg and "missing common.pt" in msg and "unexpected stray.bin" in msg
    read_manifest(path, verify=False)  # the manifest itself is intact


def test_size_digest_mode_checks_sizes_only(cfg):
    path = save_checkpoint(cfg, 50, digest="size")
    shard = path / "__0_0.distcp"
    shard.write_bytes(bytes(len(shard.read_bytes())))
    read_manifest(path)  # same sizes: accepted in size mode
    shard.write_bytes(b"short")
    with pytest.raises(ManifestError, match=r"changed __0_0.distcp \(size"):
        read_manifest(path)


# ---- discovery ---------------------------------------------------------------------------------
def test_torn_save_is_skipped_with_a_warning_and_kept(cfg):
    save_checkpoint(cfg, 50)
    torn = save_checkpoint(cfg, 100, manifest=False)
    warnings: list[str] = []
    info = latest_complete(save_dir_of(cfg), warn=warnings.append)
    assert info.iteration == 50 and info.status == "complete"
    assert len(warnings) == 1 and str(torn) in warnings[0]
    assert (torn / "common.pt").exists()  # nothing deleted
    assert [(i.iteration, i.status) for i in list_checkpoints(save_dir_of(cfg))] == [(50, "complete"), (100, "torn")]


def test_corrupt_newest_checkpoint_refuses_preflight(cfg):
    save_checkpoint(cfg, 50)
    bad = save_checkpoint(cfg, 100)
    (bad / "common.pt").write_bytes(b"tampered")
    warnings: list[str] = []
    assert latest_complete(save_dir_of(cfg), warn=warnings.append).iteration == 50
    assert str(bad) in warnings[0]
    with pytest.raises(ManifestError, match="move it aside"):
        preflight(cfg, layout_from_config(cfg))


def test_no_checkpoints_means_a_fresh_start(cfg):
    assert latest_complete(save_dir_of(cfg)) is None
    assert preflight(cfg, layout_from_config(cfg)) is None


# ---- compare -------------------------------------------------------------------------------------
CASES = {
    # name: (changes, key, override, kind)
    "TP": (
        dict(parallelism={"tensor_model_parallel_size": 2}),
        "parallelism.tensor_model_parallel_size",
        "parallelism.tensor_model_parallel_size=1",
        "reshard",
    ),
    "PP": (
        dict(parallelism={"pipeline_model_parallel_size": 1}),
        "parallelism.pipeline_model_parallel_size",
        "parallelism.pipeline_model_parallel_size=2",
        "reshard",
    ),
    "VPP": (
        dict(parallelism={"virtual_pipeline_model_parallel_size": 2}),
        "parallelism.virtual_pipeline_model_parallel_size",
        "parallelism.virtual_pipeline_model_parallel_size=null",
        "reshard",
    ),
    "DP": (
        dict(parallelism={"data_parallel_size": 1}),
        "parallelism.data_parallel_size",
        "parallelism.data_parallel_size=2",
        "reshard",
    ),
    "RoPE base": (
        dict(model={"position_embedding_type": "rope", "rotary_base": 500000}),
        "model.rotary_base",
        "model.rotary_base=10000",
        "refuse",
    ),
    "RoPE scaling": (
        dict(model={"rope_scaling": "llama3"}),
        "model.rope_scaling",
        "model.rope_scaling=null",
        "refuse",
    ),
    "CP": (
        dict(parallelism={"context_parallel_size": 2}),
        "parallelism.context_parallel_size",
        "parallelism.context_parallel_size=1",
        "refuse",
    ),
    "EP": (
        dict(parallelism={"expert_model_parallel_size": 2}),
        "parallelism.expert_model_parallel_size",
        "parallelism.expert_model_parallel_size=1",
        "refuse",
    ),
    "seq_length": (dict(model={"seq_length": 64}), "model.seq_length", "model.seq_length=128", "refuse"),
    "vocab_padding": (
        dict(model={"make_vocab_size_divisible_by": 64}),
        "model.make_vocab_size_divisible_by",
        "model.make_vocab_size_divisible_by=128",
        "refuse",
    ),
    "tokenizer": (dict(data={"tokenizer": "/tok/tokenizer.json"}), "data.tokenizer", "data.tokenizer=byte", "refuse"),
    "data": (dict(data={"kind": "jsonl", "paths": ["/corpus/a.jsonl"]}), "data.paths", "data.paths=[]", "refuse"),
    "hidden": (dict(model={"hidden_size": 256}), "model.hidden_size", "model.hidden_size=128", "refuse"),
    "GBS": (
        dict(training={"global_batch_size": 32}),
        "training.global_batch_size",
        "training.global_batch_size=16",
        "reshard",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_compare_names_each_changed_key_and_its_override(cfg, name):
    changes, key, override, kind = CASES[name]
    manifest = read_manifest(save_checkpoint(cfg, 50))
    new = changed(cfg, **changes)
    mismatches = compare(manifest, new, layout_from_config(new), data_fingerprint="fp-1", tokenizer=BYTE_ID)
    by_key = {m.key: m for m in mismatches}
    assert key in by_key, format_mismatch_table(mismatches)
    assert by_key[key].override == override and by_key[key].kind == kind
    assert blocking(mismatches, allow_reshard=False)
    table = format_mismatch_table(mismatches)
    assert key in table and override in table


def test_same_config_matches(cfg):
    manifest = read_manifest(save_checkpoint(cfg, 50))
    assert compare(manifest, cfg, layout_from_config(cfg), data_fingerprint="fp-1", tokenizer=BYTE_ID) == []
    for key in ("rotary_base", "rope_scaling", "rope_scaling_factor"):  # a manifest from before these keys existed
        del manifest["config"]["model"][key]
    assert compare(manifest, cfg, layout_from_config(cfg), data_fingerprint="fp-1", tokenizer=BYTE_ID) == []


def test_tp_change_also_changes_the_padded_vocab(cfg):
    manifest = read_manifest(save_checkpoint(cfg, 50))
    new = changed(cfg, parallelism={"tensor_model_parallel_size": 2})
    pad = {m.key: m for m in compare(manifest, new, layout_from_config(new), data_fingerprint=None, tokenizer=None)}
    m = pad["model.padded_vocab_size"]
    assert (m.checkpoint, m.requested, m.kind) == (384, 512, "refuse")
    assert "make_vocab_size_divisible_by=192" in m.note  # ceil(258/384) x 384 = 384 at TP=2
    keep = changed(new, model={"make_vocab_size_divisible_by": 192})
    kinds = {
        m.key: m.kind for m in compare(manifest, keep, layout_from_config(keep), data_fingerprint=None, tokenizer=None)
    }
    assert kinds["model.make_vocab_size_divisible_by"] == "warn" and "model.padded_vocab_size" not in kinds
    assert not blocking(
        compare(manifest, keep, layout_from_config(keep), data_fingerprint=None, tokenizer=None), allow_reshard=True
    )


def test_data_content_and_tokenizer_identity(cfg, tmp_path):
    manifest = read_manifest(save_checkpoint(cfg, 50))
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text('{"model": {"type": "BPE", "vocab": {"a": 0, "</s>": 1}}}')
    (tok.parent / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    hf = tokenizer_identity(DataConfig(tokenizer=str(tok)))  # what the runtime records for a tokenizer.json
    found = {m.key: m for m in compare(manifest, cfg, layout_from_config(cfg), data_fingerprint="fp-2", tokenizer=hf)}
    assert found["data.fingerprint"].kind == "refuse" and found["data.fingerprint"].requested == "fp-2"
    assert found["tokenizer.name"].kind == "refuse" and found["tokenizer.name"].checkpoint == "byte-level"
    for file in ("tokenizer.json", "tokenizer_config.json"):  # every file that defines it
        key = f"tokenizer.sha256:{file}"
        assert found[key].kind == "refuse" and found[key].requested == hf[f"sha256:{file}"]
    assert found["tokenizer.eod"].checkpoint == 256 and found["tokenizer.eod"].requested == 1


def test_warn_only_changes_resume_with_a_warning(cfg):
    save_checkpoint(cfg, 50)
    new = changed(cfg, training={"micro_batch_size": 2, "train_iters": 400}, optimizer={"lr": 1e-4})
    warnings: list[str] = []
    info = preflight(new, layout_from_config(new), warn=warnings.append)
    assert info.iteration == 50 and {m.kind for m in info.mismatches} == {"warn"}
    assert "training.micro_batch_size" in warnings[0] and "optimizer.lr" in warnings[0]


@pytest.mark.mcore_lines
def test_a_software_upgrade_resumes_with_one_line_and_the_origin_keeps_the_old_versions(cfg):
    """megatron-core upgraded mid-run (0.16.1 -> 0.19.2 for users moving to Python 3.12): one line, not the
    table, and the next manifest's origin records what the checkpoint was saved with."""
    from importlib.metadata import version

    path = save_checkpoint(cfg, 50)
    m = read_manifest(path)
    m["versions"]["megatron-core"] = "0.15.0"
    del m["manifest_sha256"]  # as the 0.15.0 job wrote it: write_manifest checksums it
    write_manifest(path, m)
    warnings: list[str] = []
    info = preflight(cfg, layout_from_config(cfg), data_fingerprint="fp-1", warn=warnings.append)
    assert warnings == [f"versions changed since iter_0000050: megatron-core 0.15.0 -> {version('megatron-core')}"]
    origin = origin_of(info)
    assert origin["from_versions"]["megatron-core"] == "0.15.0" and origin["from_layout"] is None
    assert (
        origin_of(preflight(cfg, layout_from_config(cfg), data_fingerprint="fp-1", warn=warnings.append))[
            "from_versions"
        ]["megatron-core"]
        == "0.15.0"
    )  # still the checkpoint's (a preflight writes nothing)


@pytest.mark.mcore_lines
def test_a_checkpoint_of_a_newer_megatron_core_line_is_refused_naming_both_versions(cfg):
    """megatron-core going back a release line (a 0.19.x checkpoint under 0.16.x): refused before anything
    loads, the table naming both versions and the fix; a newer patch of the same line only warns."""
    from importlib.metadata import version

    running = version("megatron-core")
    major, minor = (int(x) for x in running.split(".")[:2])
    path = save_checkpoint(cfg, 50)
    for saved, refused in ((f"{major}.{minor + 3}.0", True), (f"{major}.{minor}.99", False)):
        m = read_manifest(path)
        m["versions"]["megatron-core"] = saved
        m.pop("manifest_sha256", None)
        write_manifest(path, m)
        warnings: list[str] = []
        if refused:
            with pytest.raises(ResumeMismatchError) as err:
                preflight(cfg, layout_from_config(cfg), data_fingerprint="fp-1", warn=warnings.append)
            row = next(line for line in str(err.value).splitlines() if line.startswith("versions.megatron-core"))
            assert [c.strip() for c in row.split("|")] == ["versions.megatron-core", saved, running, "refused"], row
            assert f"fix: run with megatron-core>={major}.{minor + 3}" in str(err.value)
        else:
            preflight(cfg, layout_from_config(cfg), data_fingerprint="fp-1", warn=warnings.append)
            assert warnings == [f"versions changed since iter_0000050: megatron-core {saved} -> {running}"]


# ---- preflight ------------------------------------------------------------------------------------
def test_preflight_refuses_a_pp_change_and_says_the_opt_in(cfg):
    save_checkpoint(cfg, 50)
    new = changed(cfg, parallelism={"pipeline_model_parallel_size": 1})
    with pytest.raises(ResumeMismatchError) as err:
        preflight(new, layout_from_config(new))
    msg = str(err.value)
    assert "iter_0000050" in msg and "checkpoint.allow_reshard=true" in msg
    assert "parallelism.pipeline_model_parallel_size=2" in msg


def test_preflight_allows_reshard_when_opted_in_and_records_origin(cfg):
    save_checkpoint(cfg, 50)
    new = changed(cfg, parallelism={"pipeline_model_parallel_size": 1}, checkpoint={"allow_reshard": True})
    info = preflight(new, layout_from_config(new), data_fingerprint="fp-1")
    origin = origin_of(info)
    assert origin["resharded"]["parallelism.pipeline_model_parallel_size"] == [2, 1]
    assert origin["from_layout"]["pipeline_model_parallel_size"] == 2 and origin["iteration"] == 50


def test_preflight_never_allows_model_shape_changes(cfg):
    save_checkpoint(cfg, 50)
    new = changed(cfg, model={"num_layers": 8}, checkpoint={"allow_reshard": True})
    with pytest.raises(ResumeMismatchError, match="model.num_layers=4"):
        preflight(new, layout_from_config(new))


def test_preflight_refuses_to_overwrite_without_auto_resume(cfg):
    save_checkpoint(cfg, 50)
    new = changed(cfg, checkpoint={"auto_resume": False})
    with pytest.raises(ResumeMismatchError, match="auto_resume"):
        preflight(new, layout_from_config(new))


# ---- run lock -------------------------------------------------------------------------------------------
HOLD = (
    "import sys; from orchestrator.ckpt.lock import RunLock; "
    "lock = RunLock(sys.argv[1]).acquire(); print('held', flush=True); sys.stdin.read()"
)


def test_second_run_is_refused_and_the_first_is_not_disturbed(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_file = run_dir / RunLock.NAME
        before = lock_file.read_text()
        with pytest.raises(RunLockedError) as err:
            RunLock(run_dir).acquire()
        assert f"pid {holder.pid}" in str(err.value) and socket.gethostname() in str(err.value)
        assert lock_file.read_text() == before and holder.poll() is None
        # the holder dies without releasing (kill -9): its lock is stale and taken over
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        with RunLock(run_dir) as lock:
            assert json.loads(lock_file.read_text())["pid"] == os.getpid() and lock.token
        assert not lock_file.exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_clean_release_lets_the_next_run_in(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):
        pass


# ---- CLI and purity -----------------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "manifest", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_cli_show_and_list(cfg):
    save_checkpoint(cfg, 50)
    save_checkpoint(cfg, 100, manifest=False)
    shown = cli("show", str(iteration_dir(save_dir_of(cfg), 50)))
    assert shown.returncode == 0 and "TP 1 x PP 2" in shown.stdout and "iteration 50" in shown.stdout
    listed = cli("list", cfg.run.dir)
    assert listed.returncode == 0
    assert "complete" in listed.stdout and "torn" in listed.stdout and "TP1 PP2" in listed.stdout
    missing = cli("show", str(iteration_dir(save_dir_of(cfg), 100)))
    assert missing.returncode == 2 and "manifest.json" in missing.stderr


def test_cli_check_composes_the_config_and_exits_1_on_mismatch(tmp_path):
    from orchestrator.config.compose import compose_config

    run_dir = tmp_path / "run"
    base = ["+experiment=gpt_pp2_dp2", f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = compose_config(base)
    ckpt = save_checkpoint(cfg, 50)
    same = cli("check", str(ckpt), "--", *base)
    assert same.returncode == 0, same.stdout + same.stderr
    other = cli("check", str(ckpt), "--", *base, "parallelism.pipeline_model_parallel_size=1")
    assert other.returncode == 1, other.stdout + other.stderr
    assert "parallelism.pipeline_model_parallel_size=2" in other.stdout


def test_data_cache_dir_default_composes(tmp_path, monkeypatch):
    """The schema's default ``${oc.env:ORCHESTRATOR_CACHE,'~/.cache/orchestrator'}`` parses and resolves."""
    from orchestrator.config.compose import compose_config

    monkeypatch.delenv("ORCHESTRATOR_CACHE", raising=False)
    assert compose_config([f"run.dir={tmp_path}"]).data.cache_dir == "~/.cache/orchestrator"
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    assert compose_config([f"run.dir={tmp_path}"]).data.cache_dir == str(tmp_path / "cache")


def test_manifest_modules_do_not_import_torch():
    code = (
        "import sys, orchestrator.ckpt.cli, orchestrator.ckpt.resume, orchestrator.ckpt.lock; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

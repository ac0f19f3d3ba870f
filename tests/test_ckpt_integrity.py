"""Checkpoint integrity that scales, and the resolved layer spec in the manifest (issue 10 items 6, 7).

The default digest (``checkpoint.digest=size``) records every file's size and hashes only
dist_checkpointing's metadata; ``sha256`` hashes every file, and ``--deep`` re-checks them all. The
cheap verification (every resume) never reads a large shard.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_manifest import BYTE_VOCAB, changed, pp2_dp2, save_checkpoint

from orchestrator.ckpt import cli as manifest_cli
from orchestrator.ckpt.compare import compare
from orchestrator.ckpt.digest import METADATA_FILES, SMALL_FILE_BYTES
from orchestrator.ckpt.manifest import build_manifest, read_manifest, write_manifest
from orchestrator.ckpt.mismatch import REFUSE, WARN, blocking
from orchestrator.config.layout import layout_from_config, padded_vocab_size
from orchestrator.errors import ManifestError


@pytest.fixture
def cfg(tmp_path: Path):
    return pp2_dp2(tmp_path / "run")


def _big_shard(path: Path) -> Path:
    """Replace rank 0's shard by one above SMALL_FILE_BYTES (what real shards are)."""
    shard = path / "__0_0.distcp"
    shard.write_bytes(os.urandom(SMALL_FILE_BYTES + 4096))
    return shard


def _flip_a_byte(file: Path, at: int = 100) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def test_default_digest_is_sizes_plus_the_checkpoint_metadata(cfg):
    path = save_checkpoint(cfg, 50, digest=None)
    files = read_manifest(path)["files"]
    assert files["mode"] == "size" == cfg.checkpoint.digest
    hashed = {e["path"] for e in files["entries"] if "sha256" in e}
    assert hashed == {".metadata", "common.pt"} <= METADATA_FILES  # the fixture writes no metadata.json
    assert files["count"] == 6 and all("size" in e for e in files["entries"])
    _flip_a_byte(path / ".metadata", at=3)  # same size, other tensor layout: caught cheaply
    with pytest.raises(ManifestError, match=r"changed \.metadata \(content\)"):
        read_manifest(path)


def test_sha256_digest_is_rechecked_in_full_only_by_deep(cfg):
    path = save_checkpoint(cfg, 50, manifest=False)
    shard = _big_shard(path)
    layout = layout_from_config(cfg).validate()
    write_manifest(
        path,
        build_manifest(
            cfg,
            layout,
            iteration=50,
            consumed_samples=800,
            checkpoint_dir=str(path),
            vocab_size=BYTE_VOCAB,
            padded_vocab_size=padded_vocab_size(BYTE_VOCAB, cfg.model.make_vocab_size_divisible_by, 1),
            tokenizer={"type": "byte", "vocab_size": BYTE_VOCAB},
            data={"fingerprint": "fp-1"},
            digest="sha256",
        ),
    )
    assert all("sha256" in e for e in read_manifest(path, deep=True)["files"]["entries"])
    _flip_a_byte(shard)  # same size: a bit rot in a large shard
    read_manifest(path)  # the cheap check (every resume) does not read large shards
    with pytest.raises(ManifestError, match=r"changed __0_0\.distcp \(content\)"):
        read_manifest(path, deep=True)
    assert manifest_cli.main(["show", str(path), "--deep"]) == 2
    assert manifest_cli.main(["show", str(path)]) == 0


def test_cli_deep_says_what_it_could_only_size_check(cfg, capsys):
    path = save_checkpoint(cfg, 50, digest="size")
    assert manifest_cli.main(["show", str(path), "--deep"]) == 0
    out = capsys.readouterr().out
    assert "deep check: 2 file(s) re-hashed and matching; 4 checked by size only" in out


# ---- resolved layer spec -------------------------------------------------------------------------
def _saved_with(cfg, impl: str) -> dict:
    """A manifest of a job whose layer spec resolved to ``impl`` (the runtime writes it back)."""
    return read_manifest(save_checkpoint(changed(cfg, model={"transformer_impl": impl}), 50))


def test_manifest_records_the_resolved_layer_spec_and_refuses_a_resume_across(cfg):
    local = _saved_with(cfg, "local")
    assert local["model"]["transformer_impl"] == "local"
    layout = layout_from_config(cfg)
    assert compare(local, cfg, layout, data_fingerprint=None, tokenizer=None) == []  # auto on CPU is local
    te = changed(cfg, model={"transformer_impl": "transformer_engine"})
    [m] = compare(local, te, layout, data_fingerprint=None, tokenizer=None)
    assert (m.key, m.checkpoint, m.requested, m.kind) == (
        "model.transformer_impl",
        "local",
        "transformer_engine",
        REFUSE,
    )
    assert m.override == "model.transformer_impl=local"
    assert blocking([m], allow_reshard=True) == [m]  # no opt-in carries it


def test_auto_on_a_gpu_cluster_is_judged_by_the_job(cfg, tmp_path):
    te_ckpt = _saved_with(pp2_dp2(tmp_path / "te"), "transformer_engine")
    gpu = changed(cfg, cluster={"kind": "slurm", "gpus_per_node": 8, "name": "slurm"})
    layout = layout_from_config(cfg)
    assert compare(te_ckpt, gpu, layout, data_fingerprint=None, tokenizer=None) == []  # undecided on the login node
    [m] = compare(te_ckpt, cfg, layout, data_fingerprint=None, tokenizer=None)  # a CPU run resolves to local
    assert (m.checkpoint, m.requested, m.kind) == ("transformer_engine", "local", REFUSE)
    old = dict(
        te_ckpt,
        model={k: v for k, v in te_ckpt["model"].items() if k != "transformer_impl"},
        config=dict(
            te_ckpt["config"],
            cluster=dict(te_ckpt["config"]["cluster"], gpus_per_node=8),
            model=dict(te_ckpt["config"]["model"], transformer_impl="auto"),
        ),
    )
    [w] = compare(old, cfg, layout, data_fingerprint=None, tokenizer=None)  # an older GPU checkpoint: unknown
    assert (w.checkpoint, w.kind) == ("unrecorded", WARN)


# ---- sha256 mode: the ranks hash in parallel ------------------------------------------------------
def _hash_rank(rank: int, port: int, path: str, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch

    from orchestrator.ckpt import digest as mf
    from orchestrator.config.schema import JobConfig
    from orchestrator.runtime.rank.distributed import init_distributed
    from orchestrator.runtime.training import checkpoint as ckpt

    try:
        init_distributed(JobConfig())
        ckpt._hash_in_parallel(Path(path))
        known = sorted(os.path.relpath(k, os.path.realpath(path)) for k in mf.KNOWN_HASHES)
        out.put((rank, known, mf.file_digest(path, "sha256")["sha256"] if rank == 0 else None))
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # reported to the parent
        out.put((rank, repr(exc), None))


def test_sha256_mode_hashes_each_file_once_across_ranks(cfg):
    import multiprocessing

    import torch  # noqa: F401  (imported before forking: the ranks inherit it)

    from orchestrator.ckpt.digest import checkpoint_files, file_digest
    from orchestrator.runtime.rank.distributed import reserve_local_port

    path = save_checkpoint(cfg, 50, manifest=False)
    files = checkpoint_files(path)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    port = reserve_local_port()
    procs = [ctx.Process(target=_hash_rank, args=(r, port, str(path), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (known, digest)) for r, known, digest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert results[0][0] == files  # rank 0 holds every file's hash: its own share and rank 1's
    assert results[1][0] == []  # rank 1 hashed its share and handed it over
    assert results[0][1] == file_digest(path, "sha256")["sha256"]  # the manifest's digest, from those hashes

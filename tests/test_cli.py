"""The command line as a user meets it: one front door.

* Every documented user error (issue 9's list, typos, Hydra's own errors, run.name escapes, bad data
  options) and a seeded sample of random configs go through the real entry point: exactly one
  ``error:`` line on stderr, exit 2, torch never imported, and the run directories' files
  byte-identical before and after (nothing created either).
* plan / dry-run write nothing; only a run that starts records ``<run.dir>/config.yaml``; a refused
  resume leaves the run directory byte-identical; Ctrl-C (SIGINT to the process group) and SIGTERM (to
  the launcher alone) make the ranks save the iteration they are at and exit (130 / 143, no traceback,
  no rank left, one line naming the checkpoint and the command that resumes); a second signal stops at
  once, unsaved, and says so; ``orchestrator stop`` stops a detached local job the same way (status
  ``stopped (by request)``), and refuses in one line a run that is not live; ``manifest check --deep``
  catches a byte flipped in a real sha256-digested shard that the default check does not read.
* ``--help`` / ``--version`` are the tool's own; the config surface is frozen.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import REPO, losses_by_iteration

from orchestrator.runtime.faults.requeue import EXIT_HUNG

# Runs many argv lists through orchestrator.__main__.main in one interpreter (Hydra and the
# schema imported once), capturing each one's stdout, stderr and exit code.
BATCH = r"""
import contextlib, io, json, sys, traceback
import orchestrator.__main__ as entry
cases = json.load(open(sys.argv[1]))
results = []
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry.main(list(argv))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = "crash: " + traceback.format_exc()
    results.append({"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
imported = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')})
json.dump({"results": results, "imported": imported}, open(sys.argv[2], "w"))
"""


def run_batch(cases: List[List[str]], cwd: Path, env: Dict[str, str] | None = None) -> List[dict]:
    """Every case through the real entry point in one fresh interpreter (cwd = ``cwd``); asserts torch-free."""
    src, dst = cwd / "cases.json", cwd / "results.json"
    src.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, "-c", BATCH, str(src), str(dst)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]  # nothing bypassed sys.stderr (e.g. Hydra's own report)
    data = json.loads(dst.read_text())
    src.unlink()
    dst.unlink()
    assert data["imported"] == [], f"the CLI imported {data['imported']} for plan/dry-run/refusals"
    return data["results"]


def snapshot(root: Path) -> Dict[str, bytes]:
    """Every file and directory under ``root`` with its bytes (directories map to b'<dir>')."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


@pytest.fixture
def workspace(tmp_path):
    """A tmp cwd holding run directories with files in them (<tmp>/a/b/runs, so ../../x stays inside)."""
    root = tmp_path / "a" / "b" / "runs"
    for name in ("gpt_tiny_none", "gpt_pp2_dp2"):
        run = root / name
        (run / "checkpoints" / "iter_0000005").mkdir(parents=True)
        (run / "checkpoints" / "iter_0000005" / "common.pt").write_bytes(os.urandom(64))
        (run / "config.yaml").write_text(f"# the config of the run that happened in {name}\n")
        (run / "metrics.jsonl").write_text('{"iteration": 1, "lm_loss": 5.5}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path, root


def assert_one_error_line(result: dict, *expected: str) -> str:
    argv, err = " ".join(result["argv"]), result["stderr"]
    assert result["code"] == 2, f"{argv}: exit {result['code']}\n{err}\n{result['stdout']}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{argv}: stderr is not one error line:\n{err}"
    assert "; fix: " in lines[0], f"{argv}: no fix in {lines[0]}"
    for text in expected:
        assert text in lines[0], f"{argv}: {text!r} not in {lines[0]}"
    return lines[0]


USER_ERRORS = [
    # typos: an unknown key or option, with or without +, says what was meant
    (["+training.micro_batch=2"], ["training.micro_batch: unknown key", "did you mean training.micro_batch_size?"]),
    (["training.micro_batch=2"], ["training.micro_batch: unknown key", "did you mean training.micro_batch_size?"]),
    (["+paralelism=tp2_pp2"], ["paralelism: unknown key", "did you mean parallelism?"]),
    (["paralelism=tp2_pp2"], ["paralelism: unknown key", "did you mean parallelism?"]),
    (["trainng.seed=3"], ["trainng.seed: unknown key", "did you mean training.seed?"]),
    (["model=gpt_6.7"], ["model=gpt_6.7: no such model", "did you mean model=gpt_6.7b?"]),
    (["+experiment=gpt_pp2"], ["experiment=gpt_pp2: no such experiment", "did you mean +experiment=gpt_pp2_dp2?"]),
    (["parallelism=tp4"], ["parallelism=tp4: no such parallelism", "tp2_pp2"]),
    # Hydra's and OmegaConf's own errors
    (["experiment=gpt_pp2_dp2"], ["experiment is an optional group", "fix: +experiment=gpt_pp2_dp2"]),
    (["+parallelism=tp2_pp2"], ["already chosen by the defaults", "fix: parallelism=tp2_pp2"]),
    (
        ["+training.micro_batch_size=2"],
        ["training.micro_batch_size is already in the config", "fix: training.micro_batch_size=2"],
    ),
    (["training.micro_batch_size=abc"], ["training.micro_batch_size: Value 'abc'", "an integer"]),
    (["training.micro_batch_size=null"], ["training.micro_batch_size: field", "not Optional"]),
    (["plan=maybe"], ["plan: Value 'maybe' is not a valid bool"]),
    (["training.micro_batch_size=["], ["training.micro_batch_size=[: not a valid override"]),
    (["training.micro_batch_size=1,2"], ["a sweep (several values) needs -m"]),
    (["run.name=${nope}"], ["run.name: Interpolation key 'nope' not found"]),
    (
        ["cluster.env.NCCL_ALGO=Ring"],
        ["cluster.env.NCCL_ALGO: not in the config yet", "fix: +cluster.env.NCCL_ALGO=Ring"],
    ),
    # a mapping's new keys: the fix is whole and quoted for the shell (it was cut at the first space)
    (["cluster.env={FOO: 1}"], ["cluster.env.FOO: not in the config yet", "fix: '++cluster.env={FOO: 1}'"]),
    (["+cluster.env={FOO: 1}"], ["cluster.env is already in the config", "fix: '++cluster.env={FOO: 1}'"]),
    (["cluster.env.FOO=a b"], ["cluster.env.FOO: not in the config yet", "fix: '+cluster.env.FOO=a b'"]),
    (["~model"], ["the model group cannot be removed"]),
    (["-m", "training.micro_batch_size=2,abc"], ["training.micro_batch_size: Value 'abc'"]),
    (["-m", "model=gpt_tiny,gpt_7b"], ["model=gpt_7b: no such model"]),
    (["-m", "+training.micro_bach_size=2,4"], ["did you mean training.micro_batch_size?"]),
    (["--frobnicate"], ["--frobnicate: unknown option"]),
    # Hydra's flags: their values checked here (argparse's usage block and "__main__.py: error:" before)
    (["--cfg", "jobx"], ["--cfg jobx: not one of job, hydra, all", "fix: --cfg job"]),
    (["model=gpt_tiny", "--cfg"], ["--cfg: needs a value"]),
    (["--resolve", "model=gpt_tiny"], ["--resolve: only with --cfg"]),
    (["-m", "model=gpt_tiny", "-m"], ["-m: given more than once"]),
    (["model=gpt_tiny", "-m", "--cfg", "job"], ["-m and --cfg: one at a time"]),
    # what used to die inside the ranks (or with a traceback under plan=true)
    (["model.recompute_granularity=full"], ["model.recompute_method=null: recompute_granularity=full needs"]),
    (
        [
            "+experiment=gpt_pp2_dp2",
            "model.recompute_granularity=full",
            "model.recompute_method=block",
            "model.recompute_num_layers=3",
        ],
        ["model.recompute_num_layers=3: must be between 1 and the layers per pipeline rank (2)"],
    ),
    (
        ["model.recompute_granularity=selective", "model.recompute_num_layers=1"],
        ["must be null with recompute_granularity=selective"],
    ),
    (["model.transformer_impl=transformer_engine"], ["model.transformer_impl=transformer_engine", "GPUs only"]),
    (["training.log_interval=0"], ["training.log_interval=0: must be a positive integer"]),
    (["model.num_query_groups=0", "plan=true"], ["model.num_query_groups=0: must be a positive integer"]),
    (
        ["+experiment=gpt_pp2_dp2", "parallelism.data_parallel_size=-2"],
        ["parallelism.data_parallel_size=-2: must be a positive integer"],
    ),
    (["cluster.tasks_per_node=0"], ["cluster.tasks_per_node=0: must be a positive integer"]),
    (["model.hidden_dropout=1.5"], ["model.hidden_dropout=1.5: must be a finite number in [0, 1)"]),
    (["model.attention_dropout=-0.1"], ["model.attention_dropout=-0.1: must be a finite number in [0, 1)"]),
    (["optimizer.weight_decay=-3"], ["optimizer.weight_decay=-3.0: must be a finite number >= 0"]),
    (["optimizer.adam_beta2=1.0"], ["optimizer.adam_beta2=1.0: must be a finite number in [0, 1)"]),
    (["optimizer.lr=0"], ["optimizer.lr=0.0: must be a finite number > 0"]),
    (["optimizer.min_lr=1"], ["optimizer.min_lr=1.0: above optimizer.lr=0.001"]),
    (
        ["model.hidden_size=130"],
        [
            "model.hidden_size=130 is not divisible by model.num_attention_heads=4",
            "fix: model.hidden_size=132 (a multiple of 4) or model.num_attention_heads=5",
        ],
    ),
    # a fix names the whole key and a value, typed as shown
    (["model.seq_length=100000"], ["fix: model.max_position_embeddings=100000 (or model.seq_length=128)"]),
    (
        ["parallelism.tensor_model_parallel_size=3"],
        ["fix: parallelism.tensor_model_parallel_size=2 (one of [1, 2, 4])"],
    ),
    (["model.num_attention_heads=5"], ["fix: model.hidden_size=130 (a multiple of 5) or model.num_attention_heads=4"]),
    (["training.precision=bf16"], ["training.precision=bf16: needs a GPU"]),
    (["parallelism.distributed_backend=nccl"], ["parallelism.distributed_backend=nccl: needs GPUs"]),
    (["training.device=cuda"], ["training.device=cuda: no GPU"]),
    (["training.fp8=hybrid"], ["training.fp8=hybrid: FP8 GEMMs are Transformer Engine's and run on GPUs only"]),
    (["+experiment=gpt_pp2_dp2", "training.global_batch_size=18"], ["training.global_batch_size=18 is not divisible"]),
    (["+experiment=gpt_pp2_dp2", "parallelism.pipeline_model_parallel_size=3"], ["model.num_layers=4"]),
    (["optimizer.name=lamb"], ["optimizer.name='lamb': not one of 'adam', 'sgd'"]),
    (["gpu=B200", "plan=true"], ["gpu='B200' is not a known GPU preset"]),
    (
        ["checkpoint.init_from=/nonexistent/iter_0000001"],
        ["checkpoint.init_from='/nonexistent/iter_0000001': no such directory"],
    ),
    # bad data options
    (["data=jsonl"], ["data.paths=[]: data=jsonl needs at least one JSONL file"]),
    (["data=jsonl", "data.paths=[a.jsonl,missing.jsonl]"], ["data.paths[1]='missing.jsonl': no such file"]),
    (["data=jsonl", "data.paths=[a.jsonl]", "data.weights=[0.5,0.5]"], ["2 weights for 1 data.paths"]),
    (["data=jsonl", "data.paths=[a.jsonl,a.jsonl]", "data.weights=[1,-1]"], ["data.weights[1]=-1.0: must be"]),
    (["data=indexed", "data.paths=[corpus]"], ["data.paths[0]='corpus': corpus.bin and .idx not found"]),
    (["data.tokenizer=tokenizer.json"], ["data.tokenizer='tokenizer.json': no such file"]),
    (["data.paths=[a.jsonl]"], ["data.paths=['a.jsonl']: data=stdlib (kind stdlib) reads no files"]),
    (["data.split='0,100,0'"], ["data.split='0,100,0': must be 1 to 3 comma-separated weights"]),
    (["data.split='100,0,0'"], ["data.split='100,0,0': no validation part, but training.eval_iters=10"]),
    # run.name escapes
    (["run.name=../../x"], ["run.name='../../x': must be one directory name"]),
    (["run.name=a/b"], ["run.name='a/b': must be one directory name"]),
    (["run.name=.."], ["run.name='..': must be one directory name"]),
    (["run.name=''"], ["run.name='': must be one directory name"]),
]


def test_every_documented_user_error_is_one_line_exit_2_and_touches_nothing(workspace):
    cwd, root = workspace
    before = snapshot(cwd)
    started = time.monotonic()
    results = run_batch([argv + [f"run.root={root}"] for argv, _ in USER_ERRORS], cwd)
    elapsed = time.monotonic() - started
    for result, (_, expected) in zip(results, USER_ERRORS):
        assert_one_error_line(result, *expected)
    assert snapshot(cwd) == before  # byte-identical, and nothing created (no .hydra/, no __main__.log, no ../../x)
    print(f"{len(USER_ERRORS)} user errors through the CLI in {elapsed:.1f} s")


def test_the_fix_of_a_new_key_in_a_mapping_works_as_typed_in_bash(workspace):
    """``cluster.env={FOO: 1}`` and its variants: the fix the error line names, read by bash, composes, and
    cluster.env then holds the new keys next to the cluster's own (``++`` merges; it does not replace)."""
    from orchestrator.config.compose import compose_dict

    cwd, root = workspace
    typed = [
        ["cluster.env={FOO: 1}"],
        ["+cluster.env={FOO: 1}"],
        ["cluster.env.FOO=1"],
        ["cluster.env={FOO: 1, BAR: 'x y'}"],
        ["cluster=hosts_dev", "cluster.env={FOO: 1}"],
    ]
    for argv, result in zip(typed, run_batch([a + [f"run.root={root}"] for a in typed], cwd)):
        fix = assert_one_error_line(result).split("; fix: ", 1)[1]
        words = subprocess.run(
            ["bash", "-c", f"printf '%s\\0' {fix}"], capture_output=True, text=True, check=True
        ).stdout.split("\0")[:-1]
        env = compose_dict(argv[:-1] + words).cluster.env
        assert env["FOO"] == "1" and ("OMP_NUM_THREADS" in env) == (len(argv) == 2), (argv, fix, env)
        assert env.get("BAR", "x y") == "x y", (argv, fix, env)


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return repr(value) if not isinstance(value, float) or value == value else "nan"


def test_random_configs_through_the_cli_are_planned_or_refused_in_one_line(workspace):
    from test_validate import BASES, PERTURB

    cwd, root = workspace
    files = {
        "jsonl": str(cwd / "a.jsonl"),
        "jsonl2": str(cwd / "a.jsonl"),
        "prefix": str(cwd / "nope"),
        "tokenizer": str(cwd / "tokenizer.json"),
    }
    rng = random.Random(9)
    cases = []
    for _ in range(40):
        changes = {k: rng.choice(PERTURB[k]) for k in rng.sample(sorted(PERTURB), rng.choice([1, 2, 3]))}
        overrides = [f"{k}={_hydra_value(v)}".format(**files) for k, v in changes.items()]
        cases.append(rng.choice(BASES) + overrides + ["plan=true", f"run.root={root}"])
    before = snapshot(cwd)
    results = run_batch(cases, cwd)
    planned = 0
    for result in results:
        if result["code"] == 0:
            assert "layers per stage" in result["stdout"] and result["stderr"] == "", result
            planned += 1
        else:
            assert_one_error_line(result)
    assert 4 <= planned <= 36, planned
    assert snapshot(cwd) == before


def test_own_configs_from_conf_config_dir_and_searchpath_ahead_of_the_shipped_ones(tmp_path):
    """./conf (no flag), --config-dir and hydra.searchpath: found by +experiment= and the name check,
    a user's file wins over a shipped one of the same name, a missing directory is one error line."""
    here, other = tmp_path / "here", tmp_path / "other"
    shipped = (REPO / "conf" / "experiment" / "gpt_pp2_dp2.yaml").read_text()
    for folder, name in ((here / "conf", "mine"), (other, "theirs")):
        (folder / "experiment").mkdir(parents=True)
        (folder / "experiment" / f"{name}.yaml").write_text(shipped.replace("name: gpt_pp2_dp2", f"name: {name}"))
    (here / "conf" / "model").mkdir()
    tiny = (REPO / "conf" / "model" / "gpt_tiny.yaml").read_text()
    (here / "conf" / "model" / "gpt_tiny.yaml").write_text(tiny.replace("num_layers: 4", "num_layers: 2"))
    (here / "conf" / "model" / "broken.yaml").write_text("num_layers: [2\n")
    typo = here / "conf" / "experiment" / "typo.yaml"  # a misspelt option in the user's own experiment file
    typo.write_text(shipped.replace("override /model: gpt_tiny", "override /model: gpt_tny"))
    (here / "conf" / "experiment" / "old.yml").write_text(shipped)  # Hydra reads .yaml only
    cases = [
        ["+experiment=mine"],
        ["--config-dir", str(other), "+experiment=theirs"],
        [f"--config-dir={other}", "+experiment=theirs"],
        [f"hydra.searchpath=[file://{other}]", "+experiment=theirs"],
        ["+experiment=theirs"],
        ["--config-dir", str(tmp_path / "nope"), "+experiment=mine"],
        ["--config-dir"],
        ["model=broken", "plan=true"],
        ["--config-dir", str(other), "+experiment=mien"],
        ["+experiment=typo"],
        ["-m", "+experiment=typo,mine"],
        ["+experiment=old"],
        ["megatron-config", "--config-dir", str(other), "+experiment=theirz"],
        ["check", "links", "--config-dir", str(other), "+experiment=theirz"],
    ]
    results = run_batch(
        [
            c + ["plan=true", f"run.root={tmp_path}/runs", "parallelism=none"] if len(c) > 1 or "=" in c[0] else c
            for c in cases
        ],
        here,
    )
    for result in results[:4]:
        assert result["code"] == 0, result
        said = [line for line in result["stdout"].splitlines() if "  ... composing" not in line]  # a slow compose
        assert said[1].startswith("[orchestrator] configs: "), result["stdout"][:300]
    assert f"configs: {here / 'conf'}, ahead of the shipped conf/" in results[0]["stdout"]
    assert f"configs: {other}, {here / 'conf'}, ahead" in results[1]["stdout"]
    assert "run mine-parallelism=none: gpt_tiny x none" in results[0]["stdout"]
    assert "layers per stage = 2 / 1 = 2" in results[0]["stdout"]  # ./conf/model/gpt_tiny.yaml, not the shipped 4
    assert_one_error_line(
        results[4],
        f"experiment=theirs: no such experiment in {here / 'conf' / 'experiment'}/ or the shipped conf/experiment/",
        "one of gpt_pp2_dp2, llama3_8b_a100x32, mine, mixtral_8x7b_a100x32",
    )
    assert_one_error_line(results[5], f"hydra.searchpath=file://{tmp_path / 'nope'}: no such directory")
    assert_one_error_line(results[6], "--config-dir: needs a directory")
    assert_one_error_line(results[7], f"{here / 'conf' / 'model' / 'broken.yaml'}, line 2: not valid YAML")
    looked = f"{other / 'experiment'}/, {here / 'conf' / 'experiment'}/ or the shipped conf/experiment/"
    assert_one_error_line(
        results[8],
        f"experiment=mien: no such experiment in {looked}; fix: did you mean "
        "+experiment=mine? one of gpt_pp2_dp2, llama3_8b_a100x32, mine, mixtral_8x7b_a100x32, theirs",
    )
    for result in results[9:11]:  # it said "no such config in conf/", naming neither the file nor where it looked
        assert_one_error_line(
            result,
            f"model=gpt_tny: no such model in {here / 'conf' / 'model'}/ or the shipped "
            f"conf/model/ (named in {typo}); fix: in that file, did you mean gpt_tiny? one of ",
        )
    assert_one_error_line(results[11], f"fix: rename {here / 'conf' / 'experiment' / 'old.yml'} to old.yaml")
    for result in results[12:]:  # the sub-tools take --config-dir too (it was "not a valid override")
        assert_one_error_line(
            result, f"experiment=theirz: no such experiment in {looked}; fix: did you mean +experiment=theirs?"
        )
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the real entry point
def _cli(
    args: List[str], cwd: Path, timeout: int = 120, env: Dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
    )


def test_the_console_entry_point_from_another_directory(workspace):
    cwd, root = workspace
    before = snapshot(cwd)
    for args, expected in [
        (["+paralelism=tp2_pp2"], "did you mean parallelism?"),
        (["model=gpt_7b"], "model=gpt_7b: no such model"),
        (["-m", "training.micro_batch_size=1,x"], "training.micro_batch_size: Value 'x'"),
    ]:
        proc = _cli(args + [f"run.root={root}"], cwd)
        assert_one_error_line(
            {"argv": args, "code": proc.returncode, "stderr": proc.stderr, "stdout": proc.stdout}, expected
        )
        assert "HYDRA_FULL_ERROR" not in proc.stdout + proc.stderr
    assert snapshot(cwd) == before
    help_text = _cli(["--help"], cwd)
    assert help_text.returncode == 0 and help_text.stderr == ""
    for text in (
        "parallelism",
        "pp2_vpp2_dp2",
        "gpt_6.7b",
        "slurm_a100_4x8",
        "experiment",
        "gpt_pp2_dp2",
        "plan=true",
        "dry_run=true",
        "gpu=",
        "manifest",
        "status",
        "sweep",
        "convert",
        "tune",
    ):
        assert text in help_text.stdout, text
    assert "Hydra" not in help_text.stdout.splitlines()[0] and "== Config ==" not in help_text.stdout
    import orchestrator

    version = _cli(["--version"], cwd)
    assert version.returncode == 0 and version.stdout.strip() == f"orchestrator {orchestrator.__version__}"


def test_plan_and_dry_run_write_nothing_and_stay_torch_free(tmp_path):
    root = tmp_path / "runs"
    cases = [
        ["+experiment=gpt_pp2_dp2", "plan=true"],
        ["+experiment=gpt_pp2_dp2", "cluster=slurm_dev", "dry_run=true"],
        ["+experiment=gpt_pp2_dp2", "parallelism=tp2_pp2", "dry_run=true"],
        [
            "model=gpt_6.7b",
            "parallelism=pp2_dp2",
            "parallelism.data_parallel_size=null",
            "cluster=slurm_a100_4x8",
            "plan=true",
            "gpu=A100-40GB",
            "training.precision=bf16",
            "training.micro_batch_size=4",
            "training.global_batch_size=256",
        ],
    ]
    results = run_batch([c + [f"run.root={root}"] for c in cases], tmp_path)
    for result in results:
        assert result["code"] == 0 and result["stderr"] == "", result
        assert "layers per stage" in result["stdout"]
    assert "#SBATCH --ntasks-per-node=4" in results[1]["stdout"] and "srun" in results[1]["stdout"]
    # an experiment's run is named by the groups chosen on the command line: no collision
    assert "run gpt_pp2_dp2:" in results[0]["stdout"]
    assert f"in {root}/gpt_pp2_dp2-parallelism=tp2_pp2" in results[2]["stdout"]
    assert not root.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- a run that starts, Ctrl-C, refused resumes
TINY = [
    "training.global_batch_size=4",
    "training.eval_iters=0",
    "training.log_interval=1",
    "model.transformer_impl=local",
    "checkpoint.save_interval=1",
]


def _sigint_default() -> None:
    """In the child before exec: SIGINT's default disposition (a shell starts background jobs with
    SIGINT ignored, and an ignored SIGINT would reach the launcher so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(
    args: List[str],
    cwd: Path,
    env: Dict[str, str],
    wait_for: str,
    sig: signal.Signals = signal.SIGINT,
    group: bool = True,
    watch: Path | None = None,
    again: signal.Signals | None = None,
):
    """Start the CLI, and once ``wait_for`` is printed send ``sig``: to its whole process group (a
    terminal's Ctrl-C reaches the launcher, submitit's controller and the ranks alike), or, with
    ``group=False``, to the launcher process alone (``kill PID``, a closed terminal's SIGHUP): then
    the launcher must stop the ranks itself. ``watch``: a run directory whose job processes are listed
    just before the signal (``.before`` of the result). ``again``: a second signal, to the launcher, 0.5 s later."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_sigint_default,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
    )
    seen, before = [], []
    for line in proc.stdout:
        seen.append(line)
        if wait_for in line:
            before = processes_of(watch) if watch is not None else []
            if group:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
            if again is not None:
                time.sleep(0.5)
                os.kill(proc.pid, again)
            break
    out, err = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(args, proc.returncode, "".join(seen) + out, err)
    result.before = before
    return result


def processes_of(run_dir: Path) -> list:
    """Live processes whose command line names ``run_dir`` (a local job's submitit task and the ranks it
    forks run ``submitit.local._local`` with a folder under it), orphans included."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def no_rank_left(run_dir: Path, within_s: float = 30) -> list:
    deadline = time.monotonic() + within_s
    while (left := processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, cache_dir):
    """One real run (1 CPU rank, a checkpoint every iteration), stopped by Ctrl-C at iteration 2. Its rank reads
    through 2 DataLoader workers (data.num_workers, forked: in the process group Ctrl-C reaches)."""
    cwd = tmp_path_factory.mktemp("interrupted")
    env = {"ORCHESTRATOR_CACHE": str(cache_dir)}
    args = [*TINY, "training.train_iters=1000", "data.num_workers=2", f"run.root={cwd / 'runs'}"]
    proc = interrupt(args, cwd, env, "iteration 2/")
    return cwd, cwd / "runs" / "gpt_tiny_none", env, proc


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_and_a_second_signal_stops_at_once(interrupted, tmp_path):
    """Ctrl-C (SIGINT to the process group) at iteration 2: the ranks save the iteration they are at and
    exit; 130, no traceback, one line naming that checkpoint and the command that resumes. SIGHUP to the
    launcher alone (a closed terminal) as the ranks come up, then Ctrl-C: the second signal stops the
    job at once, unsaved, and says so (130); no rank left either time."""
    cwd, run_dir, env, proc = interrupted
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    saved = max(int(m.parent.name[5:]) for m in (run_dir / "checkpoints").glob("iter_*/manifest.json"))
    assert last.startswith(
        "stopped after saving (SIGINT); resume from "
        f"{run_dir}/checkpoints/iter_{saved:07d} (iteration {saved}) with: python -m orchestrator "
    ), last
    assert saved >= 2 and not no_rank_left(run_dir)
    # the rank's DataLoader workers ended with its training: its exit never waited for the exit watchdog
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.err"))
    assert logs and EXIT_HUNG not in logs, logs[-2000:]
    fresh = interrupt(
        [*TINY, "training.train_iters=1000", f"run.root={tmp_path}", "run.name=fresh"],
        cwd,
        env,
        "ranks up (",
        sig=signal.SIGHUP,
        group=False,
        watch=tmp_path / "fresh",
        again=signal.SIGINT,
    )
    assert fresh.returncode == 130 and "Traceback" not in fresh.stderr, fresh.stderr
    assert "stopped at once (SIGINT a second time), unsaved; " in fresh.stderr, fresh.stderr
    assert fresh.before and not no_rank_left(tmp_path / "fresh"), fresh.before  # the job was there, then gone


def _manifest_check(ckpt: Path, args: List[str], cwd: Path, env: Dict[str, str], deep: bool):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "manifest",
            "check",
            str(ckpt),
            *(["--deep"] if deep else []),
            "--",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
    )


def _stop(args: List[str], cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "stop", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
    )


def _files(run_dir: Path) -> Dict[str, tuple]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_sigterm_saves_the_stop_iteration_stop_ends_a_live_run_and_deep_check_catches_a_flipped_byte(
    tmp_path, cache_dir
):
    """SIGTERM to the launcher alone (``kill PID``) at iteration 20 of a run that saves every 1,000: the
    ranks save the iteration they stop at (a complete checkpoint), exit 143, no process of the job 15 s
    later, one line naming that checkpoint. The same command, detached (cluster.wait=false), resumes;
    `orchestrator stop` ends it (exit 0 once stopped, `stopping` meanwhile): the stop iteration saved,
    status `stopped (by request)`; stop again, or an unknown run: exit 2, one line, nothing changed.
    The first checkpoint was saved with checkpoint.digest=sha256: `manifest check` accepts it; one byte
    flipped in its largest shard (same size) passes the default check, which does not claim to have
    re-hashed anything, and `manifest check --deep` refuses it naming the file."""
    import re

    env = {"ORCHESTRATOR_CACHE": str(cache_dir)}
    args = [  # at the shipped training.log_interval (10): the stop iterations are recorded all the same
        *(a for a in TINY[:-1] if not a.startswith("training.log_interval")),
        "checkpoint.save_interval=1000",
        "training.train_iters=1000",
        f"run.root={tmp_path}",
        "run.name=term",
        "checkpoint.digest=sha256",
    ]  # 1000: the sample indices of the interrupted fixture
    run_dir = tmp_path / "term"
    proc = interrupt(args, tmp_path, env, "iteration 20/", sig=signal.SIGTERM, group=False, watch=run_dir)
    assert proc.returncode == 143, proc.stdout[-2000:] + proc.stderr
    assert "Traceback" not in proc.stderr and proc.before, proc.stderr
    assert not no_rank_left(run_dir, within_s=15), proc.before
    m = re.search(
        r"stopped after saving \(SIGTERM\); resume from (\S+) \(iteration (\d+)\) with: "
        r"python -m orchestrator ",
        proc.stderr,
    )
    assert m and Path(m.group(1)).parent == run_dir / "checkpoints", proc.stderr
    ckpt, stop_at = Path(m.group(1)), int(m.group(2))
    assert stop_at >= 20 and sorted(run_dir.glob("checkpoints/iter_*/manifest.json")) == [ckpt / "manifest.json"]

    # the same command, detached, resumes; `orchestrator stop` ends it after a save
    subprocess.run(
        [sys.executable, "-m", "orchestrator", *args, "cluster.wait=false"],
        cwd=tmp_path,
        timeout=300,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
        check=True,
    )
    from orchestrator.submit import status

    deadline = time.monotonic() + 120
    while (status.run_status(run_dir).iteration or 0) < stop_at + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    stopped = _stop(["term", "--root", str(tmp_path)], tmp_path, env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    st = status.run_status(run_dir)
    assert st.job.describe() == "stopped (by request)" and st.iteration > stop_at, st
    assert (run_dir / "checkpoints" / f"iter_{st.iteration:07d}" / "manifest.json").exists()
    assert f"resumes from {run_dir}/checkpoints/iter_{st.iteration:07d}" in stopped.stdout, stopped.stdout
    # each attempt's first iteration and both stop iterations have their loss on record (between log intervals)
    assert {1, stop_at, stop_at + 1, st.iteration} <= set(losses_by_iteration(run_dir)), stop_at
    for bad, what in ((["term"], "is not live"), (["nope"], "no run directory")):
        before = _files(run_dir)
        again = _stop([*bad, "--root", str(tmp_path)], tmp_path, env)
        assert again.returncode == 2 and again.stderr.startswith("error: ") and what in again.stderr, again
        assert len(again.stderr.splitlines()) == 1 and _files(run_dir) == before

    ok = _manifest_check(ckpt, args, tmp_path, env, deep=True)
    assert ok.returncode == 0 and "the config matches the checkpoint" in ok.stdout, ok.stdout + ok.stderr
    assert re.search(r"deep check: \d+ file\(s\) re-hashed and matching\n", ok.stdout), ok.stdout  # all hashed
    shard = max(ckpt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cheap = _manifest_check(ckpt, args, tmp_path, env, deep=False)
    assert cheap.returncode == 0 and "re-hashed" not in cheap.stdout, cheap.stdout + cheap.stderr
    deep = _manifest_check(ckpt, args, tmp_path, env, deep=True)
    assert deep.returncode == 2 and f"changed {shard.name} (content)" in deep.stderr, deep.stdout + deep.stderr
    assert deep.stderr.startswith("error: ") and len(deep.stderr.strip().splitlines()) == 1, deep.stderr


@pytest.mark.slow
def test_only_a_run_that_starts_records_its_config(interrupted):
    _, run_dir, _, _ = interrupted
    text = (run_dir / "config.yaml").read_text()
    assert text.startswith("# the resolved config of the run started ")
    assert f"run.root={run_dir.parent}" in text.splitlines()[1]
    import yaml

    recorded = yaml.safe_load(text)
    assert recorded["training"]["train_iters"] == 1000 and recorded["run"]["dir"] == str(run_dir)
    assert recorded["data"]["cache_dir"] and "${" not in text  # resolved
    assert not (run_dir / ".hydra").exists() and not list(run_dir.glob("*.log"))


@pytest.mark.slow
def test_a_refused_resume_leaves_the_run_directory_byte_identical(interrupted):
    cwd, run_dir, env, _ = interrupted
    before = snapshot(run_dir)
    root = f"run.root={run_dir.parent}"
    results = run_batch(
        [
            [*TINY, "training.train_iters=1000", "model.hidden_size=64", root],
            [*TINY, "training.train_iters=1000", "checkpoint.auto_resume=false", root],
        ],
        cwd,
        env,
    )
    mismatch, lines = results[0], results[0]["stderr"].strip().splitlines()
    assert mismatch["code"] == 2 and lines[0].startswith("error: cannot resume from "), mismatch
    assert sum(line.startswith("error:") for line in lines) == 1
    assert any(line.startswith("model.hidden_size") and "refused" in line for line in lines[1:])
    assert_one_error_line(results[1], "checkpoint.auto_resume=false would train from scratch")
    assert snapshot(run_dir) == before


def test_a_dry_run_tells_the_resume_verdict_and_a_refusal_exits_2(interrupted):
    """dry_run/plan run the real run's resume preflight: a changed vocabulary padding, or CP=2 on the CP=1
    checkpoint, is refused (exit 2, the diff table) before the sbatch script, nothing is written; an
    unchanged request would resume."""
    cwd, run_dir, env, _ = interrupted
    before = snapshot(run_dir)
    base = [*TINY, "training.train_iters=1000", f"run.root={run_dir.parent}"]
    slurm = ["cluster=slurm_dev", "cluster.tasks_per_node=1"]
    results = run_batch(
        [
            [*base, "model.make_vocab_size_divisible_by=64", "dry_run=true"],
            [*base, *slurm, "model.make_vocab_size_divisible_by=64", "dry_run=true"],
            [*base, "model.make_vocab_size_divisible_by=64", "plan=true"],
            [*base, *slurm, "dry_run=true"],
            [
                *base,
                "cluster=slurm_a100_4x8",
                "cluster.nodes=1",
                "cluster.tasks_per_node=2",
                "parallelism.context_parallel_size=2",
                "dry_run=true",
            ],
        ],
        cwd,
        env,
    )
    cp = results[4]  # CP=2 on the CP=1 checkpoint, for a GPU cluster (validate refuses CP on CPU ranks)
    assert cp["code"] == 2 and cp["stderr"].startswith("error: cannot resume from "), cp
    rows = [[cell.strip() for cell in line.split("|")] for line in cp["stderr"].splitlines()]
    assert ["parallelism.context_parallel_size", "1", "2", "refused"] in rows, cp["stderr"]
    for refused in results[:3]:
        lines = refused["stderr"].strip().splitlines()
        assert refused["code"] == 2 and lines[0].startswith(f"error: cannot resume from {run_dir}/checkpoints/iter_"), (
            refused
        )
        assert sum(line.startswith("error:") for line in lines) == 1
        assert any(line.startswith("model.padded_vocab_size") and "refused" in line for line in lines[1:]), lines
        assert "model.make_vocab_size_divisible_by=128" in lines[-1]  # the override that matches
        assert "#SBATCH" not in refused["stdout"]
    ok = results[3]
    assert ok["code"] == 0 and ok["stderr"] == "", ok
    verdict = next(line for line in ok["stdout"].splitlines() if "would resume from" in line)
    assert verdict.startswith(f"[orchestrator] would resume from {run_dir}/checkpoints/iter_")
    assert ok["stdout"].index(verdict) < ok["stdout"].index("#SBATCH")  # the verdict above the script
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_kill_9_of_a_waiting_launcher_ends_its_local_job_and_the_rerun_resumes(tmp_path, cache_dir):
    """kill -9 of the launcher waiting on 2 forked CPU ranks: the job notices, saves, stops; no process of
    it (submitit's controller, the task, the forked rank, the checkpoint writers) is left 15 s later, the
    lock is released, the attempt is recorded; rerunning resumes, printing the change table once."""
    import psutil

    args = [
        *TINY,
        "training.micro_batch_size=2",
        "parallelism.data_parallel_size=2",
        f"run.root={tmp_path}",
        "run.name=orphan",
    ]
    run_dir = tmp_path / "orphan"
    env = dict(os.environ, PYTHONPATH=str(REPO), ORCHESTRATOR_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args, "training.train_iters=1000"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        seen = []
        for line in launcher.stdout:
            seen.append(line)
            if "iteration 3/" in line:  # two checkpoints saved: every rank has its writer process
                break
        job = psutil.Process(launcher.pid).children(recursive=True)
        assert len(job) >= 5, (job, "".join(seen)[-3000:])  # controller, rank 0's task, rank 1, 2 writers
        os.kill(launcher.pid, signal.SIGKILL)  # left a zombie (not reaped yet): it must read as dead
        killed = time.monotonic()
        alive = job
        while alive and time.monotonic() - killed < 15:
            time.sleep(0.5)
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [(p.pid, p.cmdline()) for p in alive]
    finally:
        launcher.kill()
        launcher.wait()
    from orchestrator.ckpt import attempts, history

    (attempt,) = attempts.attempts(history.read_records(run_dir))
    assert attempt.cause == "interrupted" and f"the launcher (pid {launcher.pid}) died" in attempt.message, attempt
    assert not (run_dir / "orchestrator.lock").exists()
    latest = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("iter_*"))
    assert latest >= attempt.iteration >= 3, (latest, attempt)  # the stop saved the iteration it reached

    rerun = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args, f"training.train_iters={latest + 1}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"will resume from {run_dir}/checkpoints/iter_{latest:07d}" in rerun.stdout
    assert rerun.stdout.count("with changes:") == 1 and rerun.stdout.count("training.train_iters |") == 1, rerun.stdout
    assert f"completed: iteration {latest + 1}" in rerun.stdout


def test_config_surface_is_frozen():
    """Groups and options users type; change this list deliberately, with the README."""
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in (REPO / "conf").iterdir() if d.is_dir()}
    assert groups == {
        "parallelism": ["none", "pp2_dp2", "pp2_vpp2_dp2", "pp4", "tp2_pp2"],
        "model": [
            "gpt_1.3b",
            "gpt_125m",
            "gpt_6.7b",
            "gpt_tiny",
            "llama3_70b",
            "llama3_8b",
            "llama_tiny",
            "mixtral_8x7b",
            "moe_tiny",
        ],
        "optimizer": ["adam", "sgd"],
        "data": ["indexed", "jsonl", "mock", "stdlib"],
        "training": ["default"],
        "cluster": ["hosts", "hosts_dev", "local", "slurm", "slurm_a100_4x8", "slurm_dev", "torchrun"],
        "experiment": ["gpt_pp2_dp2", "llama3_8b_a100x32", "mixtral_8x7b_a100x32"],
    }
    readme = (REPO / "README.md").read_text()
    for group, options in groups.items():
        assert f"`{group}`" in readme
        for option in options:
            assert f"`{option}`" in readme, (group, option)


LOST_SIGNAL = """
import os, signal, sys
from orchestrator.submit.signals import DetachSignals, interrupt, raise_if_interrupted
if sys.argv[1] == "entry":
    signal.signal(signal.SIGTERM, interrupt)
else:
    DetachSignals().hold()
os.register_at_fork(after_in_parent=lambda: [os.kill(os.getpid(), signal.SIGTERM), sum(range(10 ** 6))])
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("fork returned", flush=True)
try:
    raise_if_interrupted()
except KeyboardInterrupt as exc:
    print(type(exc).__name__, flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("handler", ["entry", "sweep"])
def test_a_signal_that_python_ignores_in_a_fork_hook_still_stops_the_launcher_without_a_traceback(handler):
    """A stop signal that lands while worker processes are forked (the tokenizer's, before submission) raises
    inside an at-fork hook, where Python reports "Exception ignored" with a traceback and goes on -- the
    launcher used to submit and train anyway. The handler remembers it; the pipeline's check before anything is
    recorded or submitted (submit.signals.raise_if_interrupted) raises it again. The report is kept off the
    terminal (a SLURM sweep detached by SIGHUP in a weakref callback printed one: a CI run failed on it)."""
    proc = subprocess.run(
        [sys.executable, "-c", LOST_SIGNAL, handler], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == ["fork", "returned", "KeyboardInterrupt" if handler == "entry" else "Detached"]
    assert proc.returncode == 130, (proc.returncode, proc.stdout, proc.stderr)
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_hydra_flags_after_the_overrides_are_read_as_before_them(tmp_path):
    """``-m`` / ``--cfg job`` / ``--info`` after an override used to end in argparse's usage block (Hydra's
    parser takes flags first); the entry puts them first: the same output as in Hydra's order."""

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    after, before = (
        run("training.micro_batch_size=3", "--cfg", "job"),
        run("--cfg", "job", "training.micro_batch_size=3"),
    )
    assert after.returncode == 0 and after.stderr == "", after.stderr
    assert "micro_batch_size: 3" in after.stdout and after.stdout == before.stdout
    info = run("training.micro_batch_size=3", "--info", "defaults")
    assert info.returncode == 0 and "Defaults List" in info.stdout and "error" not in info.stderr, info.stderr
    sweep = run("training.micro_batch_size=1,2", "-m", "dry_run=true", f"run.root={tmp_path}")
    assert sweep.returncode == 0 and "[sweep] 2 points" in sweep.stdout + sweep.stderr, sweep.stderr


def test_a_read_only_run_root_is_one_line_before_anything_starts(tmp_path):
    """A run.root on a read-only mount: one `error:` line naming run.root and the fix, exit 2, before the data
    are prepared (it used to end in a traceback after tokenizing)."""
    source, mount = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    mount.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(mount)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator", "+experiment=gpt_pp2_dp2", f"run.root={mount}/runs"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"error: run.root={mount}/runs: cannot create the directory {mount}/runs (Read-only file system); fix: "
    ), lines
    assert "preparing data" not in proc.stdout and list(source.iterdir()) == []
    assert "world size" not in proc.stdout, proc.stdout  # before the plan's lines


def test_a_dangling_link_or_an_unwritable_file_system_as_run_root_is_one_line(tmp_path):
    """A run.root through a symbolic link whose target is not there (scratch not mounted) and, as root (whom
    os.access always lets write), /proc: one line naming run.root and the OS's reason for the directory it tried
    (it said "/proc: No such file or directory", after 7 plan lines), exit 2, before the plan; nothing created."""
    link = tmp_path / "scratch"
    link.symlink_to(tmp_path / "not-mounted")
    cases = [
        ["+experiment=gpt_pp2_dp2", f"run.root={link}/runs"],
        ["+experiment=gpt_pp2_dp2", "run.root=/proc/runs"],
    ]
    results = run_batch(cases, tmp_path)
    said = [
        f"{link} is a symbolic link to {tmp_path / 'not-mounted'}, which does not exist here",
        "cannot create the directory /proc/runs (No such file or directory); fix: set run.root to a directory",
    ]
    for case, got, words in zip(cases, results, said):
        lines = [ln for ln in got["stderr"].splitlines() if ln.strip()]
        assert got["code"] == 2 and len(lines) == 1 and lines[0].startswith(f"error: {case[1]}: "), got
        assert words in lines[0] and "preparing data" not in got["stdout"], lines
        assert "world size" not in got["stdout"], got["stdout"]  # before the plan's lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"] and not (tmp_path / "not-mounted").exists()


def test_a_users_model_file_without_a_name_is_named_after_its_option(tmp_path):
    """``conf/model/mymodel.yaml`` without ``name:`` used to be labelled ``gpt_tiny`` (the schema's default):
    its runs went to ``runs/gpt_tiny_none``, where a real gpt_tiny run was then refused as a resume of it."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mymodel.yaml").write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    mine = subprocess.run(
        [sys.executable, "-m", "orchestrator", "model=mymodel", "plan=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert mine.returncode == 0 and "run mymodel_none: mymodel x none" in mine.stdout, mine.stdout + mine.stderr
    shipped = subprocess.run(
        [sys.executable, "-m", "orchestrator", "model=gpt_tiny", "plan=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "run gpt_tiny_none: gpt_tiny x none" in shipped.stdout, shipped.stdout + shipped.stderr

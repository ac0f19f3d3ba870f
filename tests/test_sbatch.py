"""The rendered sbatch script: golden files, preview == submission, quoting, parameter validation.

Pure and quick: no SLURM needed (submission is checked against a fake ``sbatch`` on PATH; the real
cluster is exercised in tests/test_slurm.py). Regenerate the golden files after a deliberate change
with ``ORCHESTRATOR_UPDATE_GOLDEN=1 pytest tests/test_sbatch.py``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.layout import world_size_of
from orchestrator.config.schema import ClusterConfig, JobConfig, register_configs, to_job_config
from orchestrator.errors import ConfigError, LayoutError
from orchestrator.submit import sbatch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("ORCHESTRATOR_UPDATE_GOLDEN") == "1"
INJECTION = 'x"; touch {m}/pwned1; echo "'


def compose(*overrides: str) -> JobConfig:
    """A JobConfig composed by Hydra from conf/, as the entry point does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=["run.dir=/runs/x", *overrides])
    return to_job_config(cfg)


def a100_job() -> JobConfig:
    # 4 nodes x 8 A100 = 32 ranks: GPT 6.7B with TP 2 x PP 2 x DP 8.
    return compose(
        "cluster=slurm_a100_4x8",
        "model=gpt_6.7b",
        "parallelism=tp2_pp2",
        "run.name=gpt_6.7b_tp2_pp2",
        "cluster.python=/opt/venvs/megatron/bin/python",
        "cluster.account=llm-pretrain",
        "training.global_batch_size=512",
        "training.micro_batch_size=1",
    )


def slurm_cfg(**cluster) -> JobConfig:
    base = dict(
        name="slurm",
        kind="slurm",
        nodes=1,
        gpus_per_node=0,
        tasks_per_node=4,
        timeout_min=10,
        signal_delay_s=60,
        python="/usr/bin/python3",
    )
    base.update(cluster)
    cfg = JobConfig(cluster=ClusterConfig(**base))
    cfg.run.name = "job"
    cfg.run.dir = "/runs/job"
    return cfg


def normalise(script: str) -> str:
    """Replace what varies between machines (this interpreter's path) with a placeholder."""
    return script.replace(shlex.quote(sys.executable), "<PYTHON>")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"golden file {path} did not exist and was written; review and commit it")
    assert text == path.read_text(), f"rendered script differs from {path} (ORCHESTRATOR_UPDATE_GOLDEN=1 to accept)"


# ---- golden files ------------------------------------------------------------------------------


def test_golden_a100_4x8_multi_node():
    cfg = a100_job()
    world, _ = world_size_of(cfg)
    assert world == 32
    script = sbatch.render_sbatch(cfg, world, "/shared/runs/gpt_6.7b_tp2_pp2/submitit")
    check_golden("sbatch_a100_4x8.sh", script)
    # The facts the golden file pins, spelled out.
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=USR2@180",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
        "#SBATCH --time=1440",
        "#SBATCH --account=llm-pretrain",
        "export NCCL_IB_DISABLE=0",
        "export NCCL_SOCKET_IFNAME=ib0",
    ]:
        assert line in script.splitlines()
    assert sbatch.srun_line(script).endswith(
        "--cpu-bind=none /opt/venvs/megatron/bin/python -u -m submitit.core._submit /shared/runs/gpt_6.7b_tp2_pp2/submitit"
    )


def test_golden_dev_cluster():
    cfg = compose("+experiment=gpt_pp2_dp2", "cluster=slurm_dev")
    world, _ = world_size_of(cfg)
    assert world == 4
    script = sbatch.render_sbatch(cfg, world, "/runs/gpt_pp2_dp2/submitit")
    check_golden("sbatch_slurm_dev.sh", normalise(script))
    assert "#SBATCH --partition=dev" in script.splitlines()
    assert not any(line.startswith("#SBATCH --gpus") for line in script.splitlines())  # CPU job: no GPU request
    assert "export NCCL_IB_DISABLE=1" in script.splitlines()
    assert "SOCKET_IFNAME" not in script  # gloo uses the node's hostname: right on one node and across nodes


def test_setup_order_unset_then_user_lines_then_env():
    cfg = slurm_cfg(setup=["module load cuda", "source /venv/bin/activate"], env={"NCCL_DEBUG": "INFO"})
    lines = sbatch.render_sbatch(cfg, 4, "/f").splitlines()
    start = lines.index("# setup")
    assert lines[start + 1].startswith("unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE")
    assert lines[start + 2 : start + 5] == ["module load cuda", "source /venv/bin/activate", "export NCCL_DEBUG=INFO"]


# ---- preview == submission ---------------------------------------------------------------------


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """`srun` and `sbatch` stand-ins on PATH: sbatch records the script it was given."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def _noop():
    return 0


def _production_executor(cfg: JobConfig, world: int):
    """The executor ``cluster=slurm*`` submits with (orchestrator.submit.executor.make_executor)."""
    from orchestrator.submit import executor

    return executor.make_executor(cfg, world)


def test_render_equals_what_the_production_executor_submits(fake_slurm):
    cfg = a100_job()
    cfg.run.dir = str(fake_slurm / "runs" / "gpt")
    world, _ = world_size_of(cfg)
    job = _production_executor(cfg, world).submit(_noop)
    assert job.job_id == "4242"
    submitted = (fake_slurm / "submitted.sh").read_text()
    assert submitted == sbatch.render_sbatch(cfg, world, Path(cfg.run.dir) / "submitit")
    assert "#SBATCH --nodes=4" in submitted and "#SBATCH --ntasks-per-node=8" in submitted


def test_render_equals_what_the_production_executor_submits_for_the_dev_cluster(fake_slurm):
    cfg = compose("+experiment=gpt_pp2_dp2", "cluster=slurm_dev", f"run.dir={fake_slurm / 'with space' / 'run'}")
    world, _ = world_size_of(cfg)
    _production_executor(cfg, world).submit(_noop)
    submitted = (fake_slurm / "submitted.sh").read_text()
    assert submitted == sbatch.render_sbatch(cfg, world, Path(cfg.run.dir) / "submitit")
    assert "#SBATCH --partition=dev" in submitted and "#SBATCH --signal=USR2@60" in submitted


# ---- quoting: nothing typed becomes shell -----------------------------------------------------


def test_injection_attempts_create_no_file(tmp_path):
    """Job name, paths, env values, srun args and python: all data. Run the script with bash
    (srun replaced by a stub that prints its argv) and check no marker file appears."""
    m = tmp_path / "m"
    m.mkdir()
    cfg = slurm_cfg(
        env={"EVIL": f"$(touch {m}/pwned2)`touch {m}/pwned3`; touch {m}/pwned4", "Q": 'it\'s "quoted"'},
        srun_args=[f"--comment=; touch {m}/pwned5"],
        partition=f"dev$(touch {m}/pwned6)",
        python=f"{sys.executable}; touch {m}/pwned7",
        additional_parameters={"comment": f"'; touch {m}/pwned8; '"},
    )
    cfg.run.name = INJECTION.format(m=m)
    folder = tmp_path / f"runs'$(touch {m}/pwned9)" / "submitit"
    script = sbatch.render_sbatch(cfg, 4, folder)
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text('#!/bin/sh\nfor a in "$@"; do echo "ARG:$a"; done\n')
    (bindir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert list(m.iterdir()) == []
    args = [line[4:] for line in out.stdout.splitlines() if line.startswith("ARG:")]
    # srun received the python path and the folder as single, intact arguments
    assert f"{sys.executable}; touch {m}/pwned7" in args
    assert str(folder) in args
    assert f"--comment=; touch {m}/pwned5" in args


def test_env_values_reach_the_job_verbatim(tmp_path):
    value = "a b $(x) `y` 'z' \"w\" \\ ; & | * ?"
    cfg = slurm_cfg(env={"WEIRD": value})
    script = sbatch.render_sbatch(cfg, 4, tmp_path / "f")
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0]
    out = subprocess.run(["bash", "-c", setup + '\nprintf %s "$WEIRD"'], capture_output=True, text=True)
    assert out.stdout == value


@pytest.mark.parametrize(
    "field,value",
    [
        ("name", "a\ntouch /tmp/pwned"),
        ("partition", "dev\n#SBATCH --uid=0"),
        ("account", "a\rb"),
        ("mem", "4G\n"),
    ],
)
def test_control_characters_refused(field, value):
    cfg = slurm_cfg()
    if field == "name":
        cfg.run.name = value
    else:
        setattr(cfg.cluster, field, value)
    with pytest.raises(ConfigError, match="control character"):
        sbatch.render_sbatch(cfg, 4, "/f")


# ---- parameter validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,config_key",
    [
        ("time", "cluster.timeout_min"),
        ("job_name", "run.name"),
        ("ntasks-per-node", "cluster.tasks_per_node"),
        ("partition", "cluster.partition"),
        ("signal", "cluster.signal_delay_s"),
        ("output", "submitit"),
        ("--nodes", "cluster.nodes"),
        ("gpus", "cluster.gpus_per_node"),
    ],
)
def test_additional_parameters_colliding_with_managed_ones_raise(key, config_key):
    cfg = slurm_cfg(additional_parameters={key: "1"})
    with pytest.raises(ConfigError) as info:
        sbatch.executor_parameters(cfg, 4)
    msg = str(info.value)
    assert f"cluster.additional_parameters.{key}" in msg and config_key in msg


def test_unknown_additional_parameter_raises_with_suggestion():
    cfg = slurm_cfg(additional_parameters={"reservaton": "big"})
    with pytest.raises(ConfigError, match=r"additional_parameters\.reservaton.*did you mean reservation"):
        sbatch.executor_parameters(cfg, 4)


def test_renderer_only_keys_point_to_config():
    cfg = slurm_cfg(additional_parameters={"setup": "module load x"})
    with pytest.raises(ConfigError, match="cluster.setup"):
        sbatch.executor_parameters(cfg, 4)


def test_additional_parameters_accepted_and_normalised():
    cfg = slurm_cfg(
        additional_parameters={
            "reservation": "resv1",
            "mail_type": "END",
            "exclusive": True,
            "overcommit": False,
            "hold": None,
        }
    )
    params = sbatch.executor_parameters(cfg, 4)["slurm_additional_parameters"]
    assert params == {"reservation": "resv1", "mail-type": "END", "exclusive": True, "requeue": True}
    script = sbatch.render_sbatch(cfg, 4, "/f")
    assert "#SBATCH --mail-type=END" in script and "#SBATCH --exclusive" in script
    assert "overcommit" not in script and "hold" not in script


def test_no_requeue_flag_when_requeues_disabled():
    cfg = slurm_cfg(max_num_timeout=0)
    assert "--requeue" not in sbatch.render_sbatch(cfg, 4, "/f")


def test_a_job_with_spare_nodes_survives_a_node_failure():
    """Issue 39: with cluster.spare_nodes (and in-place restarts) the job is submitted with --no-kill, so SLURM does not
    end it when a node dies and a spare can take that node's place; without spares, no --no-kill; a user's own
    no-kill is refused (managed)."""
    assert "#SBATCH --no-kill\n" in sbatch.render_sbatch(slurm_cfg(max_restarts=1, spare_nodes=1), 4, "/f")
    assert "--no-kill" not in sbatch.render_sbatch(slurm_cfg(max_restarts=1), 4, "/f")
    with pytest.raises(ConfigError, match="cluster.spare_nodes"):
        sbatch.executor_parameters(slurm_cfg(additional_parameters={"no_kill": True}), 4)


def test_world_size_must_match_allocation():
    cfg = slurm_cfg(nodes=2, tasks_per_node=4)
    with pytest.raises(LayoutError, match=r"2 x 4 = 8 tasks but the layout needs world size 4"):
        sbatch.executor_parameters(cfg, 4)


def test_tasks_default_to_one_per_gpu():
    cfg = slurm_cfg(nodes=2, gpus_per_node=8, tasks_per_node=None)
    params = sbatch.executor_parameters(cfg, 16)
    assert params["tasks_per_node"] == 8 and params["gpus_per_node"] == 8


@pytest.mark.parametrize(
    "cluster,match",
    [
        (dict(mem="lots"), "cluster.mem='lots'"),
        (dict(signal_delay_s=600, timeout_min=10), "cluster.signal_delay_s=600"),
        (dict(env={"1BAD": "x"}), "cluster.env.1BAD"),
        (dict(env={"A-B": "x"}), "cluster.env.A-B"),
        (dict(kind="local"), "cluster.kind='local'"),
        (dict(additional_parameters={"comment": ["a", "b"]}), "scalars"),
        (dict(mem="4G", additional_parameters={"mem_per_cpu": "1G"}), "both set the memory"),
    ],
)
def test_bad_values_raise_config_error(cluster, match):
    with pytest.raises(ConfigError, match=match):
        sbatch.executor_parameters(slurm_cfg(**cluster), 4)


def test_the_production_executor_accepts_every_parameter(fake_slurm):
    """submitit itself validates names (an error for unknown ones): every key we emit is known."""
    cfg = slurm_cfg(
        partition="p",
        account="a",
        qos="q",
        constraint="c",
        exclude="n1",
        mem="4G",
        cpus_per_task=2,
        srun_args=["--cpu-bind=none"],
        additional_parameters={"reservation": "r"},
        gpus_per_node=4,
    )
    cfg.run.dir = str(fake_slurm / "f")
    _production_executor(cfg, 4).submit(_noop)
    submitted = (fake_slurm / "submitted.sh").read_text()
    assert submitted == sbatch.render_sbatch(cfg, 4, Path(cfg.run.dir) / "submitit")
    for line in (
        "#SBATCH --partition=p",
        "#SBATCH --account=a",
        "#SBATCH --qos=q",
        "#SBATCH --constraint=c",
        "#SBATCH --exclude=n1",
        "#SBATCH --mem=4G",
        "#SBATCH --reservation=r",
    ):
        assert line in submitted, line


def test_sbatch_module_is_torch_free():
    code = (
        "import sys, orchestrator.submit.sbatch as s; "
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

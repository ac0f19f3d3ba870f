"""The command line as a user meets it: plan / dry-run stay torch-free, errors are one line, the surface is frozen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

TORCH_FREE = """
import sys
sys.argv = ["orchestrator", *{args!r}]
import orchestrator.__main__ as entry
try:
    entry.main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
bad = sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')}})
print('IMPORTED', bad)
sys.exit(10 if bad else (code or 0))
"""


def _run(args, tmp_path):
    code = TORCH_FREE.format(args=list(args) + [f"run.root={tmp_path}"])
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ["+experiment=gpt_pp2_dp2", "plan=true"],
    ["+experiment=gpt_pp2_dp2", "cluster=slurm_dev", "dry_run=true"],
    ["model=gpt_6.7b", "parallelism=pp2_dp2", "parallelism.data_parallel_size=null", "cluster=slurm_a100_4x8",
     "plan=true", "gpu=A100-40GB",
     "training.precision=bf16", "training.micro_batch_size=4", "training.global_batch_size=256"],
    ["+experiment=gpt_pp2_dp2", "parallelism.pipeline_model_parallel_size=3"],  # validation error
])
def test_plan_dry_run_and_validation_never_import_torch(tmp_path, args):
    proc = _run(args, tmp_path)
    assert "IMPORTED []" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "pipeline_model_parallel_size=3" in args[-1]:
        assert proc.returncode == 2 and "model.num_layers=4" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "layers per stage" in proc.stdout
    assert not (tmp_path / "gpt_pp2_dp2" / "submitit").exists()


def test_dry_run_prints_the_sbatch_script(tmp_path):
    proc = _run(["+experiment=gpt_pp2_dp2", "cluster=slurm_dev", "dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --ntasks-per-node=4" in proc.stdout and "srun" in proc.stdout


def test_user_errors_are_one_line_without_traceback(tmp_path):
    proc = _run(["+experiment=gpt_pp2_dp2", "training.global_batch_size=18"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: invalid parallel layout: training.global_batch_size=18")
    assert "Traceback" not in proc.stderr
    proc = _run(["+experiment=gpt_pp2_dp2", "optimizer.name=lamb"], tmp_path)
    assert proc.returncode == 2 and "optimizer.name='lamb'" in proc.stderr and "'adam', 'sgd'" in proc.stderr


def test_config_surface_is_frozen():
    """Groups and options users type; change this list deliberately, with the README."""
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in (REPO / "conf").iterdir() if d.is_dir()}
    assert groups == {
        "parallelism": ["none", "pp2_dp2", "pp2_vpp2_dp2", "pp4", "tp2_pp2"],
        "model": ["gpt_1.3b", "gpt_125m", "gpt_6.7b", "gpt_tiny"],
        "optimizer": ["adam", "sgd"],
        "data": ["indexed", "jsonl", "mock", "stdlib"],
        "training": ["default"],
        "cluster": ["local", "slurm", "slurm_a100_4x8", "slurm_dev"],
        "experiment": ["gpt_pp2_dp2"],
    }
    readme = (REPO / "README.md").read_text()
    for group, options in groups.items():
        assert f"`{group}`" in readme
        for option in options:
            assert f"`{option}`" in readme, (group, option)

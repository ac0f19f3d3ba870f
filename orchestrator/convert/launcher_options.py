"""The launcher's side of a Megatron-LM script: the ``#SBATCH`` options copied both ways and sbatch/srun's one-letter
options. Pure data."""

from __future__ import annotations

from typing import Dict

from orchestrator.submit.sbatch_options import MANAGED_OPTIONS

SLURM_OPTIONS: Dict[str, str] = {
    name: MANAGED_OPTIONS[name] for name in ("partition", "account", "qos", "constraint", "exclude", "mem")
}
"""``#SBATCH`` options copied as they are, both ways (``--time``, ``--nodes``, GPUs, CPUs and
``--signal`` convert with arithmetic in to_config / from_config)."""


SHORT_OPTIONS: Dict[str, str] = {
    "N": "nodes",
    "n": "ntasks",
    "c": "cpus-per-task",
    "p": "partition",
    "A": "account",
    "q": "qos",
    "t": "time",
    "J": "job-name",
    "o": "output",
    "e": "error",
    "C": "constraint",
    "x": "exclude",
    "w": "nodelist",
    "G": "gpus",
    "D": "chdir",
}
"""sbatch / srun one-letter options and their long names (``man sbatch``)."""

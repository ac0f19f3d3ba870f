"""Where ``conf/`` is, and Hydra's compose API for tools that are not the Hydra entry point.

``conf/`` lives at the repository top level (the project's design) and is shipped inside the
wheel as ``orchestrator/conf`` (``[tool.setuptools.package-dir]`` in pyproject.toml), so the
same Hydra tree is found from a source checkout, an editable install and ``pip install .``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from orchestrator.spec.schema import JobConfig

_PACKAGE = Path(__file__).resolve().parent.parent


def conf_dir() -> Path:
    """The Hydra config tree: ``<site-packages>/orchestrator/conf`` (wheel) or ``<repo>/conf``."""
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"orchestrator's conf/ not found next to {_PACKAGE} (a broken install?)")


def compose_config(overrides: List[str], config_dir: Optional[str] = None) -> JobConfig:
    """Compose ``conf/`` with ``overrides`` into a :class:`JobConfig` (Hydra's compose API).

    Raises Hydra's and OmegaConf's own exceptions; the entry point turns them into one line.
    """
    from hydra import compose, initialize_config_dir

    from orchestrator.spec.schema import register_configs, to_job_config

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir or conf_dir()), version_base=None):
        return to_job_config(compose("config", overrides=list(overrides)))

"""The callable every submitted task runs (pickled by submitit; imports torch only when called)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional


class TrainJob:
    """``TrainJob(config_dict, prepared_dict, env)()`` trains one rank and returns its summary.

    Plain data travels (dicts), not OmegaConf objects, so the pickle is small and
    version-independent; the job rebuilds the typed :class:`JobConfig`. ``env`` is
    applied before torch is imported (thread counts, NCCL settings).
    """

    def __init__(self, config: Dict[str, Any], prepared: Dict[str, Any], env: Optional[Dict[str, str]] = None):
        self.config = config
        self.prepared = prepared
        self.env = dict(env or {})

    def __call__(self) -> Dict[str, Any]:
        os.environ.update(self.env)
        from orchestrator.spec.schema import from_dict
        from orchestrator.runtime.data import PreparedData
        from orchestrator.runtime.train import run

        return run(from_dict(self.config), PreparedData(**self.prepared))

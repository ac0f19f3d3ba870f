"""The callable every submitted task runs (pickled by submitit; imports torch only when called)."""

from __future__ import annotations

from typing import Any, Dict


class TrainJob:
    """``TrainJob(config_dict, prepared_dict)()`` trains one rank and returns its summary.

    Plain data travels (dicts), not OmegaConf objects, so the pickle is small and
    version-independent; the job rebuilds the typed :class:`JobConfig`.
    """

    def __init__(self, config: Dict[str, Any], prepared: Dict[str, Any]):
        self.config = config
        self.prepared = prepared

    def __call__(self) -> Dict[str, Any]:
        from orchestrator.config import from_dict
        from orchestrator.runtime.data import PreparedData
        from orchestrator.runtime.train import run

        return run(from_dict(self.config), PreparedData(**self.prepared))

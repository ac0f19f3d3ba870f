"""megatron-core's expected warnings and 0.19's deprecation notices are dropped by
``orchestrator/runtime/rank/mcore.py`` (the one home of version differences; the runtime package quiets
them on import), and nothing else is: megatron's real import warning seen before and not after, in one
fresh interpreter, on both lines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

PROBE = """
import importlib, importlib.util, logging, warnings
spec = importlib.util.spec_from_file_location("tables", "orchestrator/runtime/rank/mcore.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)  # the tables only: the runtime package is not imported yet
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import megatron.core.optimizer
print("bare:", " | ".join(str(w.message) for w in seen))
import orchestrator.runtime  # quiets them
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", append=True)  # behind the runtime's ignore filters
    importlib.reload(megatron.core.optimizer)
print("quiet:", " | ".join(str(w.message) for w in seen))
logging.basicConfig(level=logging.WARNING, format="log: %(name)s %(message)s")
for name, prefix in tables.DROPPED_NOTICES.items():
    importlib.import_module(name)  # the logger names are megatron's own modules
    logging.getLogger(name).warning(prefix + " (probe)")
    logging.getLogger(name).warning("another notice (probe)")
"""


@pytest.mark.mcore_lines
def test_the_runtime_drops_megatrons_expected_notices_and_only_those():
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    bare, quiet = (next(line for line in done.stdout.splitlines() if line.startswith(k)) for k in ("bare:", "quiet:"))
    assert "Transformer Engine and Apex are not installed" in bare  # megatron says it (the test can fail)
    assert "Transformer Engine and Apex are not installed" not in quiet
    assert "IS DEPRECATED (probe)" not in done.stderr and "async save is deprecated (probe)" not in done.stderr
    assert done.stderr.count("another notice (probe)") == 2  # other records of those loggers still pass

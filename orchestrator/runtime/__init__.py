"""Everything that imports torch or megatron.core lives under this package."""

from orchestrator.runtime.rank.mcore import quiet_notices

quiet_notices()  # megatron-core's expected warnings and 0.19's deprecation notices (runtime/rank/mcore.py)

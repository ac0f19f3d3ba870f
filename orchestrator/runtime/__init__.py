"""Everything that imports torch or megatron.core lives under this package."""

import warnings

# megatron-core announces its fallbacks at import on every rank; they are expected on CPU and
# without Apex/Transformer Engine, and would otherwise bury the training log.
for _pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "The pad token id in the tokenizer collides"):
    warnings.filterwarnings("ignore", message=_pattern)

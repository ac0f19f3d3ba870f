"""Everything that imports torch or megatron.core lives under this package."""

import logging
import warnings

# megatron-core announces its fallbacks at import on every rank; they are expected on CPU and
# without Apex/Transformer Engine, and would otherwise bury the training log.
for _pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "The pad token id in the tokenizer collides",
                 # 0.19: TransformerConfig's own default (cuda_graph_modules="full"; CUDA graphs are off)
                 "full scope is deprecated",
                 # 0.19: importing megatron.core.models.mimo (get_megatron_optimizer does), and
                 # log_single_rank before torch.distributed is up (GPTDatasetConfig in the launcher)
                 "MimoModelConfig is experimental", "Could not determine rank from torch.distributed"):
    warnings.filterwarnings("ignore", message=_pattern)


class _DropMegatronNotices(logging.Filter):
    """megatron-core 0.19 logs two deprecations at WARNING, on every model build and first save, whose
    replacements we cannot take: ``GPTModel`` → ``HybridModel`` (no local, non-TE layer spec, and other
    state-dict keys: a 0.16 checkpoint would no longer load) and "MCore's async save" → NVRx
    (nvidia-resiliency-ext, not a dependency; 0.19's *synchronous* torch_dist save runs through the
    deprecated async path and logs it too)."""

    PREFIXES = ("GPTModel IS DEPRECATED", "MCore's async save is deprecated")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


for _name in ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch"):
    logging.getLogger(_name).addFilter(_DropMegatronNotices())

"""orchestrator: Megatron-core GPT pretraining jobs from Hydra configs, locally or on SLURM."""

__version__ = "0.1.0"

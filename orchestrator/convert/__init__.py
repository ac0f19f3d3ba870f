"""Megatron-LM launches <-> orchestrator experiments (issue 13).

* :mod:`~orchestrator.convert.megatron_args` — the one flag table (Megatron-LM flag -> our key,
  kind, Megatron-LM's default), read in both directions;
* :mod:`~orchestrator.convert.sources` and :mod:`~orchestrator.convert.shell` — shell scripts,
  args YAML and JSON -> flags + launcher options;
* :mod:`~orchestrator.convert.to_config`, :mod:`~orchestrator.convert.rules` and
  :mod:`~orchestrator.convert.launcher` — flags -> settings with every finding;
  :mod:`~orchestrator.convert.experiment_file` writes them as ``conf/experiment/NAME.yaml``;
* :mod:`~orchestrator.convert.from_config` — a composed config -> the Megatron-LM launch;
* :mod:`~orchestrator.convert.cli` — ``python -m orchestrator.convert from-megatron | to-megatron``.

Pure Python: nothing here imports torch or megatron.
"""

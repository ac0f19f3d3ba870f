"""Read a Megatron-LM launch — shell script, args YAML or JSON — into a :class:`Source`.

A shell script is read the way bash would run it, as far as a launch script needs: comments,
``\\`` line continuations, ``NAME=value`` / ``export NAME=value`` / ``NAME=( ... )`` arrays,
``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${ARRAY[@]}`` and ``$(( arithmetic ))``,
``#SBATCH`` lines, here-documents (skipped), and one launch line: ``[srun ...] [torchrun ... |
python -m torch.distributed.run ...] pretrain_gpt.py --flags`` or ``bash examples/pretrain_gpt.sh
--flags``. A file that is only flags (a fragment) is read as the flags. Nothing is executed:
``$(command)`` and variables the script does not define stay as written and are reported
(``--var NAME=VALUE`` defines them, positional ``$1`` included).

An args YAML/JSON maps Megatron-LM names (dashed or underscored) to values: ``true`` gives the
flag, ``false``/``null`` leaves it out, lists give several values, nested mappings are flattened.
Lines ``# orchestrator: ...`` carry what an export from :mod:`orchestrator.convert.from_config`
needs to come back exactly. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from orchestrator.errors import ConfigError

Option = Tuple[str, Optional[str]]


@dataclass
class Arg:
    """One Megatron-LM flag as written: ``--pipeline-model-parallel-size 4`` (line 7)."""

    flag: str
    values: List[str]
    where: str
    runtime: Tuple[str, ...] = ()
    """What its value (or its being given at all) depends on that only the running script knows
    (``$1 (its default here)``, ``$PWD (this shell's here)``), as :func:`runtime_mark` says it."""

    @property
    def text(self) -> str:
        """The flag and its values as written (for messages and comments), marked when known only at run time."""
        return " ".join([self.flag, *self.values]) + runtime_mark(self.runtime)


def runtime_mark(origins: Sequence[str]) -> str:
    """`` [run time: $1 (its default here), ...]`` for a value the running script decides, else ""."""
    return f" [run time: {', '.join(origins)}]" if origins else ""


@dataclass
class Launcher:
    """What ``#SBATCH``, ``srun`` and ``torchrun`` say: options as (long name, value) in order."""

    sbatch: List[Option] = field(default_factory=list)
    srun: Optional[List[Option]] = None
    torchrun: Optional[List[Option]] = None
    program: Optional[str] = None
    runtime: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    """``"torchrun --nnodes"`` -> the run-time origins of its value (``$SLURM_NNODES (its default here)``)."""

    def option(self, *names: str) -> Optional[Tuple[str, str]]:
        """(value, "where it was said") of the innermost launcher option among ``names``."""
        for where, opts in (("torchrun", self.torchrun), ("srun", self.srun), ("#SBATCH", self.sbatch)):
            for key, value in reversed(opts or []):
                if key in names and value is not None:
                    mark = runtime_mark(self.runtime.get(f"{where} --{key}", ()))
                    return value, f"{where} --{key}{'=' if where == '#SBATCH' else ' '}{value}{mark}"
        return None


@dataclass
class Source:
    """Everything read from one file; :mod:`orchestrator.convert.to_config` maps it."""

    path: str
    form: str
    args: List[Arg] = field(default_factory=list)
    launcher: Launcher = field(default_factory=Launcher)
    env: Dict[str, str] = field(default_factory=dict)
    setup: List[str] = field(default_factory=list)
    orchestrator: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    holders: Dict[str, str] = field(default_factory=dict)
    """An undefined variable -> the script variable first assigned from it (``CHECKPOINT_PATH=$1``:
    ``{"1": "CHECKPOINT_PATH"}``), to name what ``--var 1=...`` stands for."""
    undecided: List[Tuple[Arg, str]] = field(default_factory=list)
    """Flags set inside a branch that bash takes or not only when the script runs, each with that ``if``
    (``if [ -n "$KEY" ]`` (line 102)): listed as not converted, never read as given."""


def _scalar(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def from_mapping(data, path: str, form: str) -> Source:
    """An args mapping (``{"num-layers": 32, ...}``) or argv list (``["--num-layers", "32"]``)."""
    src = Source(path=path, form=form)
    if isinstance(data, list) and all(isinstance(t, str) for t in data):
        src.args, src.notes = read_flags([str(t) for t in data], form)
        return src
    if not isinstance(data, dict):
        raise ConfigError(
            f"FILE: {path} holds a {type(data).__name__}, not a mapping of Megatron-LM arguments; "
            "fix: write `num-layers: 32` style keys"
        )

    def walk(d: dict) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value)
                continue
            flag = "--" + str(key).strip().lstrip("-").replace("_", "-")
            where = f"key {key!r}"
            if value is True:
                src.args.append(Arg(flag, [], where))
            elif value is False or value is None:
                src.notes.append(f"{where}: {value} -> {flag} not given")
            elif isinstance(value, list):
                src.args.append(Arg(flag, [_scalar(v) for v in value], where))
            else:
                src.args.append(Arg(flag, [_scalar(value)], where))

    walk(data)
    return src


def read_flags(
    tokens: List[str], where: str, deps: Optional[List[FrozenSet[str]]] = None
) -> Tuple[List[Arg], List[str]]:
    """Megatron-LM flags with their values (the words up to the next ``--flag``); ``deps``: each word's run-time
    origins (:meth:`orchestrator.convert.shell_scope.Scope.words`), joined on its flag's :attr:`Arg.runtime`."""
    out: List[Arg] = []
    notes: List[str] = []
    deps = deps or [frozenset()] * len(tokens)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--") and len(tok) > 2:
            if "=" in tok:
                flag, value = tok.split("=", 1)
                out.append(Arg(flag, [value], where, tuple(sorted(deps[i]))))
                i += 1
                continue
            j = i + 1
            while j < len(tokens) and not (tokens[j].startswith("--") and len(tokens[j]) > 2):
                j += 1
            out.append(Arg(tok, tokens[i + 1 : j], where, tuple(sorted(frozenset().union(*deps[i:j])))))
            i = j
        else:
            notes.append(f"{where}: word {tok!r} before any flag not read")
            i += 1
    return out, notes

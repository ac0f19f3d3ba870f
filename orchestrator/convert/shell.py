"""Read a shell script the way bash would run a Megatron-LM launch (see :mod:`orchestrator.convert.sources`).

Comments, ``\\`` continuations, ``NAME=value`` / ``NAME+=`` / ``export`` / arrays, ``$NAME``, ``${NAME:-d}``,
``${ARRAY[@]}``, ``$(( arithmetic ))``, ``if`` blocks (:mod:`orchestrator.convert.shell_branches`), ``#SBATCH`` and ``# orchestrator:`` lines, here-documents
(skipped) and the one launch line (``[srun] [torchrun | python -m torch.distributed.run] X.py`` or
``bash X.sh`` followed by Megatron-LM flags). Nothing is executed: ``$(command)`` stays unknown.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Dict, List, Optional, Tuple

from orchestrator.convert.launcher_options import SHORT_OPTIONS
from orchestrator.convert.megatron_args import row
from orchestrator.convert.shell_branches import Branches
from orchestrator.convert.shell_scope import Scope
from orchestrator.convert.sources import Arg, Launcher, Option, Source, read_flags
from orchestrator.errors import ConfigError

_ASSIGN = re.compile(r"^\s*(?:(export|local|declare(?:\s+-\w+)*)\s+)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_WORD_ASSIGN = re.compile(r"^[A-Za-z_]\w*=")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_TORCHRUN_BOOL = {"standalone", "no-python", "run-path", "module", "m", "use-env"}
_SRUN_BOOL = {
    "exclusive",
    "overlap",
    "label",
    "unbuffered",
    "kill-on-bad-exit",
    "no-kill",
    "overcommit",
    "pty",
    "quiet",
    "verbose",
    "l",
    "u",
    "v",
    "Q",
    "K",
    "O",
    "X",
    "Z",
}
_FUNCTION = re.compile(r"^(?:function\s+[A-Za-z_][\w-]*\s*(?:\(\s*\))?|[A-Za-z_][\w-]*\s*\(\s*\))\s*\{$")
_OPENS = ("{", "then", "do", "else", "in")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
BASH_SETS = ("PWD", "HOME", "USER")
"""Variables bash defines for every script: read from the converting shell (the notes say so when a flag uses one)."""


def _strip_comment(line: str) -> str:
    """``line`` without its ``# comment`` (a ``#`` starting a word outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                continue
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t;("):
            return line[:i]
    return line


def _paren_depth(text: str) -> int:
    depth, quote = 0, None
    for c in text:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
    return depth


def _logical_lines(text: str, src: Source) -> List[Tuple[int, str]]:
    """Join continuations and multi-line arrays; collect ``#SBATCH`` and ``# orchestrator:`` lines."""
    out: List[Tuple[int, str]] = []
    pending, start, heredoc = "", 0, None
    for n, raw in enumerate(text.splitlines(), 1):
        if heredoc is not None:
            if raw.strip() == heredoc:
                src.notes.append(
                    f"lines {start}-{n}: here-document not read, nor carried into cluster.setup; fix: write what it "
                    "writes before the job, or add it to cluster.setup yourself"
                )
                heredoc = None
            continue
        stripped = raw.strip()
        if not pending and stripped.startswith("#SBATCH"):
            src.launcher.sbatch += _options(shlex.split(stripped[len("#SBATCH") :], comments=True), 0, set())[0]
            continue
        if not pending and stripped.startswith("# orchestrator:"):
            src.orchestrator.append(stripped[len("# orchestrator:") :].strip())
            continue
        body = _strip_comment(raw).rstrip()
        if not pending:
            start = n
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        pending += body
        if _ASSIGN.match(pending) and _paren_depth(pending) > 0:
            pending += " "
            continue
        if pending.strip():
            out.append((start, pending.strip()))
            match = _HEREDOC.search(pending)
            if match:
                heredoc = match.group(1)
        pending = ""
    if pending.strip():
        out.append((start, pending.strip()))
    return out


def _options(tokens: List, i: int, no_value: set, runtime=None, where="") -> Tuple[List[Option], int]:
    """Launcher options (long names) from ``tokens[i]`` up to the first word that is not an option. With
    ``runtime`` (``Launcher.runtime``), ``tokens`` are (word, origins) pairs and ``"<where> --NAME"`` gets the
    run-time origins of each option that has some."""
    deps = [d for _, d in tokens] if runtime is not None else [frozenset()] * len(tokens)
    tokens = [t for t, _ in tokens] if runtime is not None else tokens
    out: List[Option] = []
    while i < len(tokens) and tokens[i].startswith("-") and tokens[i] != "-":
        tok, origins = tokens[i], deps[i]
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            name, attached = name.replace("_", "-"), bool(eq)
        else:  # -N 4 or -N4
            name, value = SHORT_OPTIONS.get(tok[1], tok[1]), tok[2:]
            attached = bool(value)
        if attached:
            out.append((name, value))
            i += 1
        elif name in no_value or tok.lstrip("-") in no_value or i + 1 >= len(tokens):
            out.append((name, None))
            i += 1
        else:
            out.append((name, tokens[i + 1]))
            origins = origins | deps[i + 1]
            i += 2
        if origins and runtime is not None:
            runtime[f"{where} --{name}"] = tuple(sorted(origins))
    return out, i


def _launch(pairs) -> Optional[Tuple[Launcher, Dict[str, str], List[str], List]]:
    """(launcher, env prefix, Megatron-LM words, their run-time origins) of a launch line given as (word, origins)
    pairs, or None for another command."""
    tokens = [t for t, _ in pairs]
    launcher, env, i = Launcher(), {}, 0
    while i < len(tokens) and _WORD_ASSIGN.match(tokens[i]):
        name, _, value = tokens[i].partition("=")
        env[name] = value
        i += 1
    while i < len(tokens):
        tok, base = tokens[i], os.path.basename(tokens[i])
        if base == "srun":
            launcher.srun, i = _options(pairs, i + 1, _SRUN_BOOL, launcher.runtime, "srun")
        elif base == "torchrun":
            launcher.torchrun, i = _options(pairs, i + 1, _TORCHRUN_BOOL, launcher.runtime, "torchrun")
        elif _PYTHON.match(base):
            i += 1
            while i < len(tokens) and tokens[i] in ("-u", "-O", "-B", "-E", "-s"):
                i += 1
            if tokens[i : i + 2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
                launcher.torchrun, i = _options(pairs, i + 2, _TORCHRUN_BOOL, launcher.runtime, "torchrun")
        elif base in ("bash", "sh", "exec", "time", "nohup"):
            i += 1
        elif tok.endswith((".py", ".sh")):
            launcher.program = tok
            return launcher, env, tokens[i + 1 :], [d for _, d in pairs[i + 1 :]]
        else:
            return None
    return None


def _pick_launch(candidates: List[Tuple[int, str, Launcher, Dict[str, str], List[str], List]], path: str):
    def megatron_flags(words: List[str]) -> int:
        return sum(1 for w in words if w.startswith("--") and row(w.split("=")[0]) is not None)

    found = [c for c in candidates if megatron_flags(c[4])]
    pretrain = [c for c in found if "pretrain" in os.path.basename(c[2].program or "")]
    chosen = pretrain or found
    if len(chosen) > 1:
        lines = ", ".join(str(c[0]) for c in chosen)
        raise ConfigError(
            f"FILE: {path} has {len(chosen)} Megatron-LM launch lines (lines {lines}); "
            "fix: keep one launch per file (split the file)"
        )
    return chosen[0] if chosen else None


def parse_shell(text: str, path: str, variables: Dict[str, str]) -> Source:
    """A :class:`Source` from the text of a shell script (see the module docstring)."""
    src = Source(path=path, form="shell script")
    scope, branches = Scope(variables), Branches()
    for name in BASH_SETS:  # bash sets these for every script; this shell's values, said in the notes when read
        value = os.getcwd() if name == "PWD" else os.environ.get(name)
        if name not in scope.vars and value:
            scope.vars[name] = value
            scope.inherited.add(name)
    candidates, fragments = [], []
    function: List[Tuple[int, str]] = []
    for n, line in _logical_lines(text, src):
        where = f"line {n}"
        if function or _FUNCTION.match(line):  # a definition: carried whole into the setup lines, body not read
            function.append((n, line))
            if _function_done(function, src, branches.reading):
                function = []
            continue
        if branches.control(line, n, scope, src.notes):
            continue  # if/elif/else/fi
        if not branches.reading:  # a branch bash would not take, or one only the running script decides (listed)
            if branches.undecided:
                src.undecided += [(arg, branches.undecided) for arg in _branch_flags(line, where, scope)]
            continue
        m = _ASSIGN.match(line)
        if m and _single_word(m.group(4)):
            value = scope.assign(m.group(2), m.group(4), where, src.notes, append=m.group(3) == "+")
            if m.group(1) == "export" and value is not None:
                src.env[m.group(2)] = value
            continue
        if line.startswith("export ") and "=" not in line:
            for name in line.split()[1:]:
                if name in scope.vars:
                    src.env[name] = scope.vars[name]
            continue
        try:
            pairs = scope.words(line)
        except ValueError as exc:
            src.notes.append(f"{where}: not read ({exc})")
            continue
        if pairs and pairs[0][0].startswith("--"):
            fragments.append((n, pairs))
            continue
        launch = _launch(pairs) if pairs else None
        if launch is not None:
            candidates.append((n, line, *launch))
        elif _HEREDOC.search(line):
            continue  # its text was skipped (noted): the command alone would hang or write nothing
        else:  # runs before the job, where the script's own variables are gone: their values written in
            src.setup.append(scope.expand(line, script_only=True))
    chosen = _pick_launch(candidates, path)
    if chosen is not None:
        n, _, launcher, env, words, deps = chosen
        launcher.sbatch = src.launcher.sbatch
        src.launcher = launcher
        src.env.update(env)
        src.args, notes = read_flags(words, f"line {n}", deps)
        src.notes += notes
    src.setup += [c[1] for c in candidates if c is not chosen]
    if chosen is None:
        for n, pairs in fragments:
            args, notes = read_flags([t for t, _ in pairs], f"line {n}", [d for _, d in pairs])
            src.args += args
            src.notes += notes
    src.holders = scope.holders
    src.notes += [
        f"${name} is not defined in the script (set at run time?); fix: --var {name}=VALUE if a converted flag needs it"
        for name in scope.unresolved
        if name != "$(...)"
    ]
    src.notes += [
        f"${name} is this shell's ({scope.vars[name]}), as bash would set it" for name in sorted(scope.used_inherited)
    ]
    if "$(...)" in scope.unresolved:
        src.notes.append("$(command) substitutions are not run; their values stay unknown")
    return src


def _branch_flags(line: str, where: str, scope: Scope) -> List[Arg]:
    """The Megatron-LM flags a line of an undecided branch would add (``ARGS+=( ... )`` or a command's ``--flags``),
    read without assigning anything."""
    m = _ASSIGN.match(line)
    text = m.group(4).strip() if m else line
    if text[:1] == "(" and text.endswith(")"):
        text = text[1:-1]
    try:
        pairs = scope.words(text)
    except ValueError:
        return []
    first = next((i for i, (w, _) in enumerate(pairs) if w.startswith("--") and len(w) > 2), len(pairs))
    return read_flags([w for w, _ in pairs[first:]], where, [d for _, d in pairs[first:]])[0]


def _function_done(function: List[Tuple[int, str]], src: Source, reading: bool) -> bool:
    """Whether the (line number, line) pairs of a function definition are complete (braces balanced); once they
    are, the definition goes to the setup lines as one line (where bash would define it) and the notes say so."""
    lines = [line for _, line in function]
    if sum(p.endswith("{") for p in lines) > sum(p.startswith("}") for p in lines):
        return False
    if reading:
        src.setup.append(_one_line(lines))
        name = re.match(r"(?:function\s+)?([\w-]+)", lines[0]).group(1)
        src.notes.append(
            f"lines {function[0][0]}-{function[-1][0]}: function {name} carried into cluster.setup as one line; "
            "its body is not read for flags"
        )
    return True


def _one_line(lines: List[str]) -> str:
    """A multi-line function definition as one shell line: ``; `` between commands, a blank after ``{``,
    ``then``, ``do``, ``else`` and ``in`` (where bash refuses a ``;``)."""
    out = lines[0]
    for line in lines[1:]:
        out += (" " if out.endswith(_OPENS) or out.endswith(";") else "; ") + line
    return out


def _single_word(rhs: str) -> bool:
    """Whether ``NAME=rhs`` is a plain assignment (not ``NAME=x command args``)."""
    rhs = rhs.strip()
    if rhs[:1] == "(" or rhs[:2] == "$(":
        return rhs.endswith(")") and _paren_depth(rhs) == 0
    try:
        return len(shlex.split(rhs)) <= 1
    except ValueError:
        return True

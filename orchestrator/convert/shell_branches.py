"""``if`` / ``elif`` / ``else`` / ``fi`` in a launch script, as bash would take them where the reader can tell.

Megatron-LM's own launch scripts build their flags in branches (``if [[ "$DTYPE" == "fp8" ]]; then
DTYPE_ARGS+=(...)``, mock data unless a tokenizer is given). A condition made of ``[[ A == B ]]``, ``!=``,
``[ A = B ]``, ``-z A`` / ``-n A``, ``!``, joined by ``||`` / ``&&`` (bash: equal precedence, left to right), is
evaluated once its variables are known (:class:`~orchestrator.convert.shell_scope.Scope`); the branch bash would take
is read, the others are skipped. A condition the reader cannot evaluate (a file test, ``$(command)``, a variable set
at run time) leaves every branch of that ``if`` unread: the notes say which lines and why, and the flags inside are
listed as not converted with that reason (:attr:`Branches.undecided`), never lost. A condition decided from a value
only the running script knows (``${3:-MOCK}``) passes that origin on to every value set inside
(:attr:`~orchestrator.convert.shell_scope.Scope.context`). Pure Python.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import FrozenSet, List, Optional

_OPEN = re.compile(r"^(if|elif)\s+(.+?)\s*(?:;\s*then)?$")
_SPLIT = re.compile(r"\s*(\|\||&&)\s*")


def _test(text: str, scope) -> Optional[bool]:
    """One ``[ ... ]`` / ``[[ ... ]]`` test: True, False, or None when the reader cannot tell."""
    m = re.fullmatch(r"(!\s*)?\[\[?\s*(.*?)\s*\]\]?", text.strip())
    if not m:
        return None
    try:
        words = shlex.split(scope.expand(m.group(2)))
    except ValueError:
        return None
    negate = bool(m.group(1))
    if words[:1] == ["!"]:
        negate, words = not negate, words[1:]
    if any("$" in w for w in words):
        return None
    if len(words) == 3 and words[1] in ("==", "=", "!="):
        value = (words[0] == words[2]) != (words[1] == "!=")
    elif len(words) in (1, 2) and words[0] in ("-z", "-n"):
        empty = len(words) == 1 or words[1] == ""
        value = empty if words[0] == "-z" else not empty
    else:
        return None
    return value != negate


def evaluate(condition: str, scope) -> Optional[bool]:
    """An ``if`` condition (module docstring); None when any part that decides it is unknown."""
    parts = _SPLIT.split(condition.strip())
    result, op = _test(parts[0], scope), None
    for part in parts[1:]:
        if part in ("||", "&&"):
            op = part
            continue
        value = _test(part, scope)
        if op == "||":
            result = True if True in (result, value) else (None if None in (result, value) else False)
        else:
            result = False if False in (result, value) else (None if None in (result, value) else True)
    return result


@dataclass
class _Block:
    start: int
    condition: str
    active: Optional[bool]
    taken: bool
    unknown: bool
    deps: FrozenSet[str]


class Branches:
    """The ``if`` blocks open at the current line. :meth:`control` consumes ``if``/``elif``/``else``/``then``/``fi``
    lines; :attr:`reading` says whether a line is in the branch bash would take (every enclosing one known)."""

    def __init__(self) -> None:
        self.stack: List[_Block] = []

    @property
    def reading(self) -> bool:
        return all(b.active is True for b in self.stack)

    @property
    def undecided(self) -> Optional[str]:
        """``if COND`` (line N) when the current line is in a branch bash may or may not take: every enclosing
        branch taken, undecided, or not taken on a value only the running script knows (``${KEY:-}``); else None."""
        if any(b.active is False and not b.deps for b in self.stack):
            return None
        block = next((b for b in reversed(self.stack) if b.active is not True), None)
        return None if block is None else f"`if {block.condition}` (line {block.start})"

    def _evaluate(self, condition: str, scope) -> Optional[bool]:
        scope.touched = set()
        value = evaluate(condition, scope)
        self._deps = frozenset(scope.touched)
        return value

    def control(self, line: str, n: int, scope, notes: List[str]) -> bool:
        """Whether ``line`` (logical line ``n``) was a branch keyword; notes an ``if`` whose branches were not read."""
        word = line.split(None, 1)[0] if line.strip() else ""
        m = _OPEN.match(line)
        self._deps: FrozenSet[str] = frozenset()
        if word == "if" and m:
            value = self._evaluate(m.group(2), scope) if self.reading or self.undecided else False
            self.stack.append(_Block(n, m.group(2), value, value is True, value is None, self._deps))
        elif word == "elif" and m and self.stack:
            top = self.stack[-1]
            value = False if top.taken else self._evaluate(m.group(2), scope)
            if top.unknown and value is True:
                value = None  # taken only if the undecided conditions above are false
            top.active, top.taken, top.unknown = value, top.taken or value is True, top.unknown or value is None
            top.deps |= self._deps
        elif word == "else" and self.stack:
            top = self.stack[-1]
            top.active = None if top.unknown else not top.taken
        elif word == "fi" and self.stack:
            top = self.stack.pop()
            if top.unknown and (self.reading or self.undecided):
                notes.append(
                    f"lines {top.start}-{n}: `if {top.condition}` cannot be decided here (a file test, a command or "
                    "a value set at run time); the flags inside it are listed as not converted; fix: --var NAME=VALUE "
                    "for its variables, or move the flags out of the if"
                )
        elif word != "then":
            return False
        scope.context = frozenset().union(*(b.deps for b in self.stack))
        return True

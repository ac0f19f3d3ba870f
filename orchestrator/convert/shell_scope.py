"""The variables of a launch script as our reader sees them: assignments, ``$VAR`` / ``${VAR:-default}`` / arrays /
``$((arithmetic))`` expanded, and what could not be resolved remembered (said in the conversion's not-converted
list). Pure Python."""

from __future__ import annotations

import ast
import operator
import re
import shlex
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

from orchestrator.convert.shell_words import raw_words

VAR_RE = re.compile(
    r"""\$\(\((?P<arith>.*?)\)\)
    | \$\{(?P<arr>\w+)\[[@*]\]\}
    | \$\{(?P<braced>\w+)(?::?-(?P<dflt>[^}]*))?\}
    | \$(?P<plain>[A-Za-z_]\w*|\d)""",
    re.X,
)


ARITH_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class Scope:
    """Shell variables and arrays seen so far; ``expand`` substitutes them like bash would.

    Each value also carries its run-time origins (:attr:`deps`): the names whose values only the running script
    knows (``$1``, ``${MASTER_PORT:-29500}``, ``$PWD``, ``$(command)``), each said with what the reader used for
    it (``$1 (its default here)``), so a flag built from them says so on its row."""

    def __init__(self, given: Dict[str, str]):
        self.given = dict(given)
        self.vars: Dict[str, str] = dict(given)
        self.arrays: Dict[str, List[str]] = {}
        self.commands: set = set()
        """Names assigned from ``$(command)``: never run, so their values stay unknown."""
        self.unresolved: List[str] = []
        self.inherited: set = set()
        """Names bash sets for every script (``PWD``...), taken from the converting shell."""
        self.used_inherited: set = set()
        self.holders: Dict[str, str] = {}
        """An undefined variable -> the variable first assigned from it (``CHECKPOINT_PATH=$1``)."""
        self.deps: Dict[str, FrozenSet[str]] = {}
        """A scalar -> the run-time origins of its value."""
        self.item_deps: Dict[str, List[FrozenSet[str]]] = {}
        """An array -> the run-time origins of each item."""
        self.context: FrozenSet[str] = frozenset()
        """The run-time origins of the ``if`` conditions around the current line (set by ``Branches``)."""
        self.touched: Set[str] = set()
        """Run-time origins read by the expansions since it was last emptied."""
        self.overridden: Set[str] = set()
        """Script variables replaced with ``--var`` (the user's value, not a run-time one)."""

    def _miss(self, name: str, text: str) -> str:
        if name not in self.unresolved:
            self.unresolved.append(name)
        return text

    def _arith(self, expr: str) -> Optional[str]:
        expr = re.sub(r"\$\{?(\w+)\}?", r"\1", expr).replace("/", "//")
        for used in re.findall(r"[A-Za-z_]\w*", expr):
            self.touched |= self.deps.get(used, frozenset())
        expr = re.sub(r"[A-Za-z_]\w*", lambda m: self.vars.get(m.group(0), m.group(0)), expr)

        def ev(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in ARITH_OPS:
                return ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
            raise ValueError(expr)

        try:
            return str(ev(ast.parse(expr.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError):
            return None

    def _value(self, m: "re.Match[str]", quoted: bool) -> str:
        if m.group("arith") is not None:
            value = self._arith(m.group("arith"))
            return value if value is not None else self._miss(m.group(0), m.group(0))
        if m.group("arr"):
            items = self.arrays.get(m.group("arr"))
            if items is None:
                return self._miss(m.group("arr"), "")
            for deps in self.item_deps.get(m.group("arr"), []):
                self.touched |= deps
            return " ".join(items)  # unquoted: bash splits each element into words (``"--fp8-format hybrid"``)
        name = m.group("braced") or m.group("plain")
        if name in self.commands:
            self.touched.add(f"${name} = $(command) (not run here)")
            return self._miss("$(...)", "$" + name)
        if name in self.vars:
            value = self.vars[name]
            self.touched |= self.deps.get(name, frozenset())
            if name in self.inherited:
                self.used_inherited.add(name)
                self.touched.add(f"${name} (this shell's here)")
            elif name in self.given and name not in self.overridden:
                self.touched.add(f"${name} (--var here)")
        elif name in self.arrays:
            value = (self.arrays[name] or [""])[0]
            self.touched |= (self.item_deps.get(name) or [frozenset()])[0]
        elif m.group("dflt") is not None:
            self.touched.add(f"${name} (its default here)")
            value = self.expand(m.group("dflt"))
        else:
            self.touched.add(f"${name} (unknown here)")
            return self._miss(name, "$" + name)
        return value.replace("\\", "\\\\").replace('"', '\\"') if quoted else value

    def _script_defined(self, m: "re.Match[str]") -> bool:
        """Whether the reference ``m`` reads only what the script (or ``--var``) defines: never the environment
        the line will run in (``$SLURM_JOB_ID``, ``$PWD``, ``$(command)``)."""
        if m.group("arith") is not None:
            return all(self._script_defined_name(n) for n in re.findall(r"[A-Za-z_]\w*", m.group("arith")))
        if m.group("arr") is not None:
            return m.group("arr") in self.arrays
        return self._script_defined_name(m.group("braced") or m.group("plain"))

    def _script_defined_name(self, name: str) -> bool:
        """A scalar the script sets (its value written in, as the job will not have it), not one it reads from the
        environment the line runs in (``$PWD``, ``$SLURM_JOB_ID``)."""
        return name in self.vars and name not in self.inherited

    def expand(self, text: str, script_only: bool = False) -> str:
        """``text`` with variables, arrays and arithmetic substituted (not inside single quotes); ``script_only``:
        only the script's own variables (a line kept to run later, where the environment has the rest)."""
        out, i, single, double = [], 0, False, False
        while i < len(text):
            c = text[i]
            if c == "'" and not double:
                single = not single
            elif c == '"' and not single:
                array = re.match(r'"\$\{(\w+)\[@\]\}"', text[i:]) if not double else None
                if array and array.group(1) in self.arrays:
                    out.append(" ".join(shlex.quote(t) for t in self.arrays[array.group(1)]))
                    i += array.end()
                    continue
                double = not double
            elif c == "\\" and not single:
                out.append(text[i : i + 2])
                i += 2
                continue
            elif c == "$" and not single:
                m = VAR_RE.match(text, i)
                if m and (not script_only or self._script_defined(m)):
                    out.append(self._value(m, double))
                    i = m.end()
                    continue
                if text.startswith("$(", i):
                    self._miss("$(...)", "")
            out.append(c)
            i += 1
        return "".join(out)

    def words(self, text: str) -> List[Tuple[str, FrozenSet[str]]]:
        """The words bash would pass for ``text`` (expanded, split, quotes removed), each with its run-time
        origins (plus :attr:`context`); ``"${A[@]}"`` and ``${A[@]}`` keep each item's own. ValueError on an
        unbalanced quote."""
        out: List[Tuple[str, FrozenSet[str]]] = []
        for raw in raw_words(text):
            whole = re.fullmatch(r'("?)\$\{(\w+)\[[@*]\]\}\1', raw)
            if whole and whole.group(2) in self.arrays:
                items, deps = self.arrays[whole.group(2)], self.item_deps.get(whole.group(2), [])
                for item, dep in zip(items, [*deps, *[frozenset()] * (len(items) - len(deps))]):
                    split = [item] if whole.group(1) else shlex.split(item)
                    out += [(word, dep | self.context) for word in split]
                continue
            self.touched = set()
            expanded = self.expand(raw)
            out += [(word, frozenset(self.touched) | self.context) for word in shlex.split(expanded)]
        return out

    def assign(self, name: str, rhs: str, where: str, notes: List[str], append: bool = False) -> Optional[str]:
        """Record ``name=rhs`` (an array when ``rhs`` is ``( ... )``; ``append``: ``name+=rhs``); the scalar
        value, if any."""
        if name in self.given:
            notes.append(f"{where}: {name} given with --var; the script's value is not used")
            self.overridden.add(name)
            return self.vars[name]
        rhs = rhs.strip()
        if rhs.startswith("(") and rhs.endswith(")"):
            pairs = self.words(rhs[1:-1])
            keep = append and name in self.arrays
            self.arrays[name] = (self.arrays[name] if keep else []) + [word for word, _ in pairs]
            self.item_deps[name] = (self.item_deps.get(name, []) if keep else []) + [dep for _, dep in pairs]
            return None
        if append and name in self.vars:
            rhs = f'"${{{name}}}"{rhs}'
        if re.search(r"\$\((?!\()|`", rhs):
            self.commands.add(name)
            self.vars.pop(name, None)
            return None
        self.touched = set()
        words = shlex.split(self.expand(rhs)) if rhs else [""]
        self.vars[name] = " ".join(words)
        self.deps[name] = frozenset(self.touched) | self.context
        for used in re.findall(r"\$\{?(\w+)", self.vars[name]):
            if used in self.unresolved:
                self.holders.setdefault(used, name)
        return self.vars[name]

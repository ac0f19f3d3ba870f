"""Terminal tables, rendered once, through ``rich``: one look for every table the tool prints.

:func:`table` returns plain text (no colour codes, fixed width), so the same string goes to a
terminal, a log file or a test assertion.
"""

from __future__ import annotations

import io
from typing import Any, Iterable, Optional, Sequence


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    title: Optional[str] = None,
    right: Sequence[int] = (),
    width: int = 200,
) -> str:
    """Render ``rows`` under ``headers`` as a plain-text table.

    ``right``: indexes of right-aligned (numeric) columns. Cells are ``str()``-ed; ``None`` shows
    as ``-``. ``width``: the console width in characters (long tables are not wrapped below it).
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False)
    for i, h in enumerate(headers):
        t.add_column(str(h), justify="right" if i in right else "left", overflow="fold")
    for row in rows:
        t.add_row(*("-" if c is None else str(c) for c in row))
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, color_system=None, highlight=False, emoji=False, markup=False).print(
        t
    )
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines() if line.strip())


def show(value: Any) -> str:
    """A value as the user types it in an override: null, true/false, 'text', 3, 0.5."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)

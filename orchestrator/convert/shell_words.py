"""Split one logical shell line into its words before expansion, the way bash delimits them: on blanks outside
quotes, ``$( ... )``, ``$(( ... ))`` and ``${ ... }``, quotes kept in the word (expansion and quote removal come
after, :meth:`orchestrator.convert.shell_scope.Scope.words`), so each word's value can be traced to the variables
it read. Pure Python."""

from __future__ import annotations

from typing import List

_CLOSE = {"'": "'", '"': '"', "$(": ")", "${": "}", "(": ")"}


def raw_words(text: str) -> List[str]:
    """The words of ``text`` (unexpanded, quotes kept); an unbalanced quote or bracket ends the last word."""
    words: List[str] = []
    word: List[str] = []
    stack: List[str] = []
    i = 0
    while i < len(text):
        c, top = text[i], stack[-1] if stack else None
        opener = text[i : i + 2] if text[i : i + 2] in ("$(", "${") else None
        if top == "'":
            if c == "'":
                stack.pop()
        elif c == "\\":
            word.append(text[i : i + 2])
            i += 2
            continue
        elif opener and top != "'":
            stack.append(_CLOSE[opener])
            word.append(opener)
            i += 2
            continue
        elif top is not None and c == top:
            stack.pop()
        elif top == '"':
            pass
        elif c in "'\"":
            stack.append(c)
        elif c == "(" and top == ")":
            stack.append(")")
        elif c.isspace() and top is None:
            if word:
                words.append("".join(word))
                word = []
            i += 1
            continue
        word.append(c)
        i += 1
    if word:
        words.append("".join(word))
    return words

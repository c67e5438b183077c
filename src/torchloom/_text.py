"""Small helpers for the wording of torchloom's messages."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the form that agrees with it: "1 rank", "2 ranks", "1 process", "3 processes"."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {plural or (noun + 'es' if noun.endswith(('s', 'sh', 'ch', 'x')) else noun + 's')}"

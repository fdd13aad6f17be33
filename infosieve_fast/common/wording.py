"""Counts in the words a reader expects: "1 known class", "2 known classes", "1,200 images"."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`n` (thousands separated) and `noun` agreeing in number: the plural adds "es" after s, x, ch and sh, else "s"
    (the nouns infosieve counts: class, image, cluster, sample)."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"

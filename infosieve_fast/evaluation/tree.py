"""The implicit category tree of learned codes (paper §3): code prefixes are tree nodes.

A sample's code is the sign of its binary digits (`code_raw > 0` -> "1"), cut at the first digit the masker switches
off (`mask < 0.5`), so a short code stops high in the tree and a long one reaches a fine-grained leaf.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from ..common.labels import NO_LABEL


def code_strings(code_raw: Tensor, mask: Tensor, threshold: float = 0.5) -> list[str]:
    """Each row's code as a '0'/'1' string, truncated before the first digit whose mask is below `threshold`."""
    if code_raw.shape != mask.shape or code_raw.dim() != 2:
        raise ValueError(f"code_raw and mask must both be [N, L], got {tuple(code_raw.shape)} and {tuple(mask.shape)}")
    bits = (code_raw > 0).cpu()
    kept = (mask >= threshold).cpu()
    # length = index of the first switched-off digit (L when none is)
    off = ~kept
    length = torch.where(off.any(1), off.int().argmax(1), torch.full((len(off),), off.shape[1]))
    return ["".join("1" if b else "0" for b in row[:n].tolist()) for row, n in zip(bits, length.tolist(), strict=True)]


def build_tree(codes: list[str], targets: list[int] | Tensor, max_depth: int) -> dict:
    """Nested nodes {"prefix", "n", "ends", "classes", "purity", "children"} down to `max_depth` digits.

    `n` counts the samples whose code starts with the prefix, `ends` those whose code is exactly the prefix (or is cut
    at `max_depth`), `classes` the target counts among the `n`, `purity` the majority class's share of them. Samples
    whose target is `NO_LABEL` (no label at all) count in `n` and `ends` only; a node with none but them has no
    classes and purity None.
    """
    targets = targets.tolist() if isinstance(targets, Tensor) else list(targets)
    if len(codes) != len(targets):
        raise ValueError(f"{len(codes)} codes but {len(targets)} targets")
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")

    def node(prefix: str, members: list[int]) -> dict:
        classes = Counter(targets[i] for i in members if targets[i] != NO_LABEL)
        depth = len(prefix)
        ends = [i for i in members if len(codes[i]) == depth or depth == max_depth]
        out = {
            "prefix": prefix,
            "n": len(members),
            "ends": len(ends),
            "classes": dict(sorted(classes.items())),
            "purity": max(classes.values()) / classes.total() if classes else (0.0 if not members else None),
            "children": [],
        }
        if depth < max_depth:
            for digit in "01":
                child = [i for i in members if len(codes[i]) > depth and codes[i][depth] == digit]
                if child:
                    out["children"].append(node(prefix + digit, child))
        return out

    return node("", list(range(len(codes))))


def format_tree(tree: dict, class_names: list[str] | None = None) -> str:
    """An indented text rendering: prefix, size, majority class and purity per node."""
    lines = []

    def walk(n: dict) -> None:
        top = max(n["classes"], key=n["classes"].get) if n["classes"] else None
        name = class_names[top] if class_names is not None and top is not None else top
        indent = "  " * len(n["prefix"])
        purity = "no labels" if n["purity"] is None else f"{n['purity']:.2f}"
        lines.append(f"{indent}{n['prefix'] or '(root)'}  n={n['n']}  ends={n['ends']}  top={name} ({purity})")
        for child in n["children"]:
            walk(child)

    walk(tree)
    return "\n".join(lines)

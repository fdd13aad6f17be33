"""Whether a run's codes carry its classes yet, so that a code prefix may be shown as a place in the category tree.

The measure is the purity of the depth-8 code prefixes (the share of the images in their prefix's majority class) on
the images with a label, against chance: the mean purity of the same prefixes with the labels shuffled `SHUFFLES`
times (seed 0). Chance is not one over the classes: one prefix for all images is as pure as the largest class, and
many small prefixes are pure by their size alone. The codes carry the classes when the purity lies at least `CARRY`
of the way from chance to 1. Why 0.25: on 20 cub100 species (docs/tree.md, depth 8) codes under the published loss
stay at one to four prefixes and purity 0.07-0.14, within a few hundredths of chance, while the tree configs' codes
reach purity 0.43-0.68 with 20-50 prefixes of about 900 images, where chance is about 0.1-0.15 (estimated for prefixes
of even size, not measured): a third of the way from chance or more. 0.25 lies between. After one epoch of a tree
config every image can still have the same code: the purity is then chance, and no prefix is shown.
"""

from __future__ import annotations

import numpy as np

from ..common.labels import NO_LABEL

SEPARATION_DEPTH = 8
CARRY = 0.25  # share of the way from chance purity to 1 the codes must reach
SHUFFLES = 20
TRAIN_LONGER = (
    "on 20 cub100 species the codes reached depth-8 purity 0.64 after configs/cub100-tree.yaml's 12 epochs and "
    "0.50 after 6, and stay at chance under a config without the tree switches (docs/tree.md)"
)


def prefix_purity(prefixes: np.ndarray, labels: np.ndarray) -> float:
    """The share of the images in their prefix's majority class (`prefixes`: group ids, `labels`: classes)."""
    counts = np.zeros((prefixes.max() + 1, labels.max() + 1), np.int64)
    np.add.at(counts, (prefixes, labels), 1)
    return float(counts.max(1).sum() / len(labels))


def code_separation(codes: dict[int, str], targets: dict[int, int], depth: int = SEPARATION_DEPTH) -> dict:
    """{"depth", "images", "purity", "chance", "carries"} of the codes (by uq) of the images whose target is a class
    (not `NO_LABEL`): the purity of their `depth`-digit prefixes, its mean over `SHUFFLES` shufflings of the labels,
    and whether the purity lies `CARRY` of the way from that chance to 1 (never where chance is 1 already: prefixes of
    one image each tell nothing). Fewer than two classes: nothing to separate,
    `carries` False."""
    labelled = sorted(u for u, t in targets.items() if t != NO_LABEL and u in codes)
    if len({targets[u] for u in labelled}) < 2:
        return {"depth": depth, "images": len(labelled), "purity": None, "chance": None, "carries": False}
    _, labels = np.unique([targets[u] for u in labelled], return_inverse=True)
    _, prefixes = np.unique([codes[u][:depth] for u in labelled], return_inverse=True)
    purity = prefix_purity(prefixes, labels)
    rng = np.random.RandomState(0)
    chance = float(np.mean([prefix_purity(prefixes, rng.permutation(labels)) for _ in range(SHUFFLES)]))
    return {
        "depth": depth,
        "images": len(labelled),
        "purity": round(purity, 6),
        "chance": round(chance, 6),
        "carries": chance < 1 and purity >= chance + CARRY * (1 - chance),  # chance 1: every prefix is one image
    }


def separation_text(separation: dict) -> str:
    """One line on the codes: that their prefixes are shown, or that they have not separated the classes yet and how
    long training took for them to."""
    if separation["purity"] is None:
        return (
            "No code prefix is shown: without labelled images of two classes or more, it cannot be told whether the "
            "codes carry the classes."
        )
    measured = (
        f"depth-{separation['depth']} code prefixes {separation['purity']:.2f} pure on the {separation['images']:,} "
        f"labelled images, {separation['chance']:.2f} by chance"
    )
    if separation["carries"]:
        return f"The codes carry the classes ({measured}): each novel cluster's code prefix is shown."
    return (
        f"The codes have not separated the classes yet ({measured}), so no code prefix is shown. Train longer for "
        f"them: {TRAIN_LONGER}."
    )

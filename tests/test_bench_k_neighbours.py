"""benchmarks/bench_k_neighbours.py's class orders: with `--shuffle-classes` the known classes are a random draw of
the set's, not its first ones, which the count's answer shows where the classes differ in size."""

import json

import numpy as np

from benchmarks import bench_k_neighbours
from tests.test_estimate_k import _blobs


def _expected_k(sizes: np.ndarray, known: np.ndarray) -> float:
    """The count on well separated blobs, up to the noise of the shares read off 10 to 30 labelled images a class:
    the new images in classes of the known classes' mean size."""
    new = ~np.isin(np.arange(len(sizes)), known)
    return len(known) + sizes[new].sum() / sizes[known].mean()


def test_shuffled_classes_take_the_known_ones_at_random(tmp_path):
    """8 well separated blobs, the first 4 of 20 images, the last 4 of 60; 4 known. As listed, the known classes hold
    20 images each, so the 240 new images make 12 classes: K = 16. Shuffled by seed 0 and 1, the classes the
    permutation renumbers 0-3 are known (two small, two large in both), so the 160 new images make classes of 40:
    K = 8. The blobs do not mix, so `k_if_mixed` is the count and the range holds it."""
    sizes = np.array([20] * 4 + [60] * 4)
    x, y = _blobs(8, 60, dim=32)
    keep = np.concatenate([np.flatnonzero(y == c)[: sizes[c]] for c in range(8)])
    path, out, listed = tmp_path / "blobs.npz", tmp_path / "shuffled.json", tmp_path / "listed.json"
    np.savez(path, F=x[keep], y=y[keep])
    bench_k_neighbours.main(
        ["--features", str(path), "--sets", "all:4", "--shuffle-classes", "2", "--resamples", "0", "--json", str(out)]
    )
    bench_k_neighbours.main(["--features", str(path), "--sets", "all:4", "--resamples", "0", "--json", str(listed)])
    as_listed = json.loads(listed.read_text())["results"][0]
    assert as_listed["class_order_seed"] is None and abs(as_listed["rows"][0]["k_unrounded"] / 16 - 1) < 0.05
    shuffled = json.loads(out.read_text())["results"]
    assert [r["class_order_seed"] for r in shuffled] == [0, 1]
    for result in shuffled:
        assert result["variant"].endswith(", classes shuffled") and result["true_k"] == 8
        known = np.argsort(np.random.RandomState(result["class_order_seed"]).permutation(8))[:4]
        row = result["rows"][0]
        assert abs(row["k_unrounded"] / _expected_k(sizes, known) - 1) < 0.1, (known, row["k_unrounded"])
        assert abs(row["k_if_mixed"] - row["k_unrounded"]) < 1e-6 and row["k_range"][0] <= row["k"] <= row["k_range"][1]

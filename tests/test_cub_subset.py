"""The species subsets the real-bird benchmarks train on: a range of cub100's species, renumbered from 0, holding
exactly those species' images (the held-out protocol chooses on one range and reports on another)."""

import pytest

from benchmarks.cub_subset import write_cub_subset
from infosieve_fast.data.writing.layouts import read_dataset


def test_a_range_of_species_is_renumbered_and_holds_exactly_their_images(realdata, tmp_path):
    src = realdata / "cub100"
    names = [line.split(", ", 1)[1] for line in (src / "classes.txt").read_text().splitlines()]
    labels = [int(line.split(", ")[1]) for line in (src / "image_class_labels.txt").read_text().splitlines()]
    raw = read_dataset("cubfiles", write_cub_subset(src, 5, tmp_path / "sub", first=40))
    assert raw.class_names == names[40:45]
    assert len(raw.train) == sum(40 <= c < 45 for c in labels)
    for path, label in zip(raw.train, raw.train_labels, strict=True):
        assert path.split("/")[-2] == names[40 + int(label)]  # each image under its own species, renumbered


def test_species_outside_the_set_are_refused(realdata, tmp_path):
    with pytest.raises(ValueError, match=r"species 98\.\.102 do not exist: .* holds 100"):
        write_cub_subset(realdata / "cub100", 5, tmp_path / "sub", first=98)

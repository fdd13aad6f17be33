"""`benchmarks/synthetic_shards.py`: a class image carries its class in its mean colour; the lazy make-shards source
pickles without its pixels and reads in PIL."""

from __future__ import annotations

import pickle

import numpy as np

from benchmarks import synthetic_shards

CLASSES = 10


def test_synthetic_images_carry_their_class():
    """A class image's mean colour is its palette colour; the lazy source pickles without pixels and reads in PIL."""
    from PIL import Image

    colours = synthetic_shards.palette(CLASSES)
    assert len({tuple(c) for c in colours.tolist()}) == CLASSES
    for i in range(20):
        img = synthetic_shards.class_image(i, i % CLASSES, colours, 64, 0)
        assert np.abs(img.reshape(-1, 3).mean(0) - colours[i % CLASSES]).max() < 8
    src = synthetic_shards.SyntheticImage("class", 3, 3, 64, 0, CLASSES)
    src.read(4)
    copy = pickle.loads(pickle.dumps(src))
    assert copy._buf is None and len(pickle.dumps(src)) < 1000
    with Image.open(copy) as im:
        assert im.size == (64, 64) and np.array_equal(np.asarray(im.convert("RGB")), src.pixels())
    nat = synthetic_shards.SyntheticImage("natural", 0, 0, 256, 0, 2).pixels()
    assert nat.shape[0] == 256 and 256 <= nat.shape[1] <= 384

"""Issue 43, item 3: the same images must not give another K through their stored size. The estimate is scale-free
(the features are L2-normalised before k-means and the novelty test), and where the view the features come from
differs (the same crop of images served larger), the run's log names the setting."""

import numpy as np

from infosieve_fast.data.splits import gcd_split
from infosieve_fast.evaluation.estimate_k import estimate_k
from infosieve_fast.evaluation.feature_view import describe_feature_view, made_for


def test_a_feature_scale_moves_nothing():
    """Features times 40 (what a backbone whose outputs grow with the input's size would give): every K scored, the
    answer, the range and the novelty statistic are those of the features as they are, by either rule."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(8), 25)
    x = rng.normal(size=(8, 16))[y] * 3 + rng.normal(size=(len(y), 16))
    labelled, _ = gcd_split(y, list(range(4)), 0.5, 0)
    plain, scaled = (estimate_k(f, y, labelled, 4, rule="score", k_max=16, silhouette=False) for f in (x, x * 40))
    for key in ("k", "k_range", "k_by_argmax", "novelty"):
        assert plain[key] == scaled[key], key
    assert plain["criteria"]["labelled_accuracy"] == scaled["criteria"]["labelled_accuracy"]
    counted = [estimate_k(f, y, labelled, 4)["count"] for f in (x, x * 40)]
    assert counted[0] == counted[1]  # the neighbours count: its shares, sizes and range


def test_the_log_names_the_setting_that_moved_the_view():
    """configs/cub100-tree.yaml crops 112 px, made for 112 / 0.875 = 128 px (the reference's Resize(256) before
    CenterCrop(224)). Shards of the same images at 128 px: the crop sees 112 / 128 = 88% of the shorter side, and
    nothing is said beyond it; at 256 px, 44%, and the line names the size the crop is made for and the fix."""
    assert made_for(224) == 256 and made_for(112) == 128
    assert describe_feature_view(112, 128) == (
        "the features are those of the centre 112 px crop of images served at 128 px (shorter side), 88% of it"
    )
    assert describe_feature_view(112, 256) == (
        "the features are those of the centre 112 px crop of images served at 256 px (shorter side), 44% of it; the "
        "crop is made for 128 px: served at another size, the same images give other features and another K (set "
        "data.resize=128, or make the shards with make-shards --resize 128)"
    )
    assert describe_feature_view(32, None) == "the features are those of the centre 32 px crop of each image"

"""benchmarks/bench_second_round.py: round 1's novel clusters named by majority (one cluster per novel species, the
larger wins), and the export that makes round 2's known classes and pool, on a hand-made case and on blobs."""

import numpy as np
import torch

from benchmarks.bench_second_round import majority_names, second_round
from infosieve_fast.data.splits import gcd_split
from tests.test_estimate_k import _blobs


def test_majority_names_one_cluster_per_novel_species_the_larger_wins():
    """2 known species (0, 1); clusters 2-5 are novel. Cluster 2 (species 2, 2, 2, 0) is named 2; cluster 3 (2, 2, 3)
    is mostly 2 too but smaller, so it stays unnamed; cluster 4 (1, 1, 3) is mostly a known species: unnamed; cluster
    5 (3, 3) is named 3. Known cluster 0 is never named."""
    clusters = np.array([2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 0])
    species = np.array([2, 2, 2, 0, 2, 2, 3, 1, 1, 3, 3, 3, 3])
    assert majority_names(clusters, species, 2) == {2: 2, 5: 3}


def test_two_named_blobs_leave_a_pool_of_known_classes_and_k_is_their_number():
    """3 known and 2 novel well separated blobs: round 1 finds and names both novel ones, every novel pool image
    joins the labelled ones (none of another species), and round 2's pool is the known blobs' other half: nothing
    new, so estimate-k answers the 5 classes now known (z -3.2). In 32 dimensions instead of 256 the same draw gives
    z 2.9 and K = 6: the named classes are labelled whole (40 images, the known ones 20), so their points lie nearer
    their own means, the labelled points' distance quantile is lower and more of the pool lies beyond it. Without the
    novelty test, the neighbours count reads each class by its own share of labelled neighbours, so the named classes,
    labelled whole, do not make the known ones' unlabelled half look new: it counts 5 too; the score answers 6."""
    x, y = _blobs(5, 40, dim=256)
    labelled = np.asarray(gcd_split(y, [0, 1, 2], 0.5, 0)[0], bool)
    x = torch.from_numpy(x).float()
    x = x / x.norm(dim=1, keepdim=True)
    counted, scored = (second_round(x, y, labelled, 3, 2, 0, rule) for rule in ("neighbours", "score"))
    for found in (counted, scored):
        assert (found["known"], found["named"], found["moved"], found["moved_other_species"]) == (5, 2, 80, 0)
        assert (found["pool"], found["leftovers"], found["new_species_in_pool"]) == (60, 0, 0)
        assert found["k"] == 5 and found["novelty_z"] < 2.5
    assert counted["k_by_neighbours"] == 5 and scored["k_by_score"] == 6

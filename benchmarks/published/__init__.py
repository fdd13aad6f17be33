"""Transcriptions of the published InfoSieve code, the baseline for benchmarks and the oracle for tests.

Written from the description in docs/reference.md (not copied from the public code); not part of the installed package.

* `model`: the model and loss modules (`SupConLoss`, `info_nce_logits`, `HLoss`, `NormPLoss`, `Norm0Loss`,
  `DINOHead`, `DINOLABELLING`), the names `kernels.compat` replaces.
* `kmeans`: the loop-based semi-supervised k-means (GCD's and InfoSieve's balanced two-phase variant).
* `train`: the published training step and epoch (model build, freezing, SGD, epoch schedule, loss composition,
  per-epoch pseudo-labels, weighted sampler), fp32.
"""

"""What the features K is estimated from were computed on, said beside the estimate (`kmeans.n_clusters: auto`).

The test view is the centre `crop` of each image as served (`data/reading/augment.py`), not of the image resized to
the reference's `int(crop / 0.875)`: the same images served larger give a smaller, magnified middle of each bird to
the same crop, other features, and another K (issue 43: shards of the same images at 128 px gave K = 10, at 256 px
K = 7, with crop 112). The estimate itself is scale-free (it L2-normalises the features), so what moves K is the
view; this line names the setting that set it.
"""

from __future__ import annotations


def made_for(crop: int) -> int:
    """The shorter side a centre crop of `crop` px is made for: the reference's test transform, Resize(int(crop /
    0.875)) then CenterCrop(crop) (256 for 224)."""
    return int(crop / 0.875)


def describe_feature_view(crop: int, served: int | None) -> str:
    """One line: the view the features came from, and, where the images are served at another size than the crop is
    made for, that this size moves the features and K, and the setting that puts it right."""
    if served is None:
        return f"the features are those of the centre {crop} px crop of each image"
    said = (
        f"the features are those of the centre {crop} px crop of images served at {served} px (shorter side), "
        f"{min(1.0, crop / served):.0%} of it"
    )
    view = made_for(crop)
    if served == view:
        return said
    return (
        f"{said}; the crop is made for {view} px: served at another size, the same images give other features and "
        f"another K (set data.resize={view}, or make the shards with make-shards --resize {view})"
    )

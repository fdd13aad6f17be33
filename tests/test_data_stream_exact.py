"""ShardSource at scale semantics: the reference's sampler from one global draw, whole non-square images, unreadable
samples skipped and counted, and the streaming and cached paths serving the same batches."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.sampler import reference_labelled_share
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.reading.tar import index_shards
from infosieve_fast.data.writing.shards import make_shards

RESIZE, CROP = 32, 24
SHAPES = [(48, 80), (90, 40), (32, 32), (60, 45)]  # (h, w) of the raw images: landscape, portrait, square


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """64 train + 16 test synthetic images of 4 classes and 4 shapes, stored losslessly (PNG) at shorter side 32."""
    base = tmp_path_factory.mktemp("exact")
    rng = np.random.default_rng(0)
    for split, n in (("train", 16), ("test", 4)):
        for c in range(4):
            d = base / "raw" / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                h, w = SHAPES[(i + c) % 4]
                pixels = (rng.random((h, w, 3)) * 64 + c * 48).astype(np.uint8)
                Image.fromarray(pixels).save(d / f"{i:03d}.png")
    out = base / "shards"
    make_shards(
        "imagefolder",
        base / "raw",
        out,
        shard_size_mb=0.02,
        resize=RESIZE,
        workers=1,
        progress=False,
        image_format="png",
    )
    return out


def _stored(shards, split="train") -> dict[int, torch.Tensor]:
    """Every stored image by uq, decoded with PIL straight from the tars (an independent reader)."""
    out = {}
    for path in sorted(shards.glob(f"*-{split}-*.tar")):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if name.endswith(".png"):
                uq = int(members[name[:-4] + ".uq"])
                out[uq] = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    return out


def _images(batch) -> list[torch.Tensor]:
    if batch.sizes is None:
        return list(batch.images)
    return [img[:, :h, :w] for img, (h, w) in zip(batch.images, batch.sizes.tolist(), strict=True)]


@pytest.mark.parametrize("cache", ["off", "cpu"])
def test_whole_stored_images_are_served(shards, cache):
    """Each image arrives whole at its stored size (shorter side 32, aspect kept), the test view is torchvision's
    CenterCrop of it, and every training view is a (possibly flipped) crop of its own image."""
    stored = _stored(shards)
    assert {tuple(s.shape[1:]) for s in stored.values()} == {(32, 53), (72, 32), (32, 32), (42, 32)}
    src = ShardSource(shards, ReadOptions(cache=cache, num_workers=2))
    aug = DeviceAugment(AugmentConfig(crop_size=CROP, mean=(0.0,) * 3, std=(1.0,) * 3))
    seen = 0
    for batch in src.feature_batches(16):
        assert batch.sizes is not None  # mixed sizes
        for img, uq in zip(_images(batch), batch.uq.tolist(), strict=True):
            assert torch.equal(img, stored[uq])
        test = aug.test_view(batch.images, batch.sizes)
        want = torch.stack([TF.center_crop(stored[u], [CROP, CROP]) for u in batch.uq.tolist()]).float() / 255
        torch.testing.assert_close(test, want, rtol=0, atol=1e-6)
        views = aug.train_views(batch.images, 2, torch.Generator().manual_seed(seen), batch.sizes)
        for i, view in enumerate(views):
            img = stored[int(batch.uq[i % len(batch.uq)])].float() / 255
            crops = img.unfold(1, CROP, 1).unfold(2, CROP, 1)  # [3, nh, nw, CROP, CROP]: every crop position
            hit = [
                ((crops - v[:, None, None]).abs() < 1e-6).flatten(3).all(-1).all(0).any() for v in (view, view.flip(-1))
            ]
            assert hit[0] or hit[1], "a training view is not a crop of its image"
        seen += len(batch.uq)
    assert seen == 64


def test_max_aspect_caps_the_longer_side_by_a_centre_crop(shards):
    stored = _stored(shards)
    src = ShardSource(shards, ReadOptions(cache="off", num_workers=0, max_aspect=1.5))
    for batch in src.feature_batches(64):
        for img, uq in zip(_images(batch), batch.uq.tolist(), strict=True):
            s = stored[uq]
            h, w = s.shape[1:]
            ch, cw = (min(h, int(1.5 * w)), w) if h > w else (h, min(w, int(1.5 * h)))
            assert torch.equal(img, s[:, (h - ch) // 2 : (h - ch) // 2 + ch, (w - cw) // 2 : (w - cw) // 2 + cw])


def test_epoch_is_one_global_draw_split_over_ranks_and_workers(shards):
    """Two ranks x two workers: the ranks' batches interleave into the epoch's global draw (exactly N draws), the
    streaming and cached paths serve the same samples, and every epoch reshuffles across shards."""
    n = 64
    for cache in ("off", "cpu"):
        ranks = [
            ShardSource(shards, ReadOptions(cache=cache, num_workers=2, seed=3), rank=r, world_size=2) for r in range(2)
        ]
        order = ranks[0].epoch_order(epoch=5, seed=1)
        assert torch.equal(order, ranks[1].epoch_order(epoch=5, seed=1)) and len(order) == n
        per_rank = [[b.uq for b in s.train_batches(4, epoch=5, seed=1)] for s in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == n // 8
        served = torch.cat([torch.cat(pair) for pair in zip(*per_rank, strict=True)])
        assert torch.equal(served, order)
    shard_of = {}
    index, _ = index_shards([str(p) for p in sorted(shards.glob("*-train-*.tar"))])
    for s, u in zip(index.shard, index.uq, strict=True):
        shard_of[int(u)] = int(s)
    assert len(set(shard_of.values())) >= 4
    orders = [ranks[0].epoch_order(epoch=e, seed=1) for e in range(3)]
    assert not torch.equal(orders[0], orders[1])
    assert len({shard_of[int(u)] for u in orders[0][:8]}) >= 2  # one global batch spans shards


def test_draws_follow_the_reference_sampler_weights(shards):
    """The labelled share of many epochs' draws matches the reference's WeightedRandomSampler expectation
    (U+L)/(2U+L), and each sample's draw rate its weight (labelled 1, unlabelled L/(U+L), normalised)."""
    src = ShardSource(shards, ReadOptions(cache="off", num_workers=0))
    lab = torch.from_numpy(src.labelled)
    n_lab, n_unl = int(lab.sum()), int((~lab).sum())
    draws = torch.cat([src.epoch_order(epoch=e, seed=0) for e in range(2000)])
    share = lab[draws].float().mean().item()
    want = reference_labelled_share(n_lab, n_unl)
    assert abs(share - want) < 4 * (want * (1 - want) / len(draws)) ** 0.5
    weights = torch.where(lab, 1.0, n_lab / (n_unl + n_lab)).double()  # the published sampler's weights
    rate = torch.bincount(draws, minlength=64).double() / len(draws)
    expected = weights / weights.sum()
    assert float(((rate - expected) ** 2 / expected).sum() * len(draws)) < 63 + 4 * (2 * 63) ** 0.5  # chi-square
    shuffled = ShardSource(shards, ReadOptions(cache="off", num_workers=0, sampling="shuffle")).epoch_order(0, 0)
    assert sorted(shuffled.tolist()) == list(range(64))


def _break_one_image(shards) -> int:
    """Corrupt the pixel data (the zlib stream of the PNG) of one stored image in place; returns its uq."""
    path = sorted(shards.glob("*-train-*.tar"))[1]
    index, _ = index_shards([str(path)])
    data = bytearray(path.read_bytes())
    a = int(index.offset[2])
    data[a + 40 : a + 80] = b"\x00" * 40  # after the IHDR chunk: the header still reads, the pixels do not
    path.write_bytes(bytes(data))
    return int(index.uq[2])


@pytest.mark.parametrize("cache", ["off", "cpu"])
def test_an_unreadable_image_is_skipped_counted_and_never_drawn(shards, tmp_path, cache, capfd):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    uq = _break_one_image(broken)
    src = ShardSource(broken, ReadOptions(cache=cache, num_workers=2))
    got = torch.cat([b.uq for b in src.feature_batches(16)]).tolist()
    assert sorted(got) == [u for u in range(64) if u != uq]
    assert src.unreadable() == [uq] and f"uq {uq}" in capfd.readouterr().err
    src.exclude(src.unreadable())
    drawn = torch.cat([b.uq for e in range(5) for b in src.train_batches(8, epoch=e, seed=0)])
    assert len(drawn) == 5 * (63 // 8) * 8 and uq not in drawn.tolist()
    assert src.describe(uq)["shard"] == sorted(p.name for p in broken.glob("*-train-*.tar"))[1]


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory):
    """Smooth synthetic images of mixed shapes as JPEG shards (the format nvJPEG decodes)."""
    base = tmp_path_factory.mktemp("jpeg")
    for c in range(4):
        d = base / "raw" / f"class{c}"
        d.mkdir(parents=True)
        for i in range(12):
            h, w = SHAPES[(i + c) % 4]
            y, x = np.mgrid[0:h, 0:w]
            pixels = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, 40 * c + 3 * i)], -1).astype(np.uint8)
            Image.fromarray(pixels).save(d / f"{i:03d}.png")
    out = base / "shards"
    make_shards("imagefolder", base / "raw", out, shard_size_mb=0.01, resize=RESIZE, workers=1, progress=False)
    return out


@pytest.mark.gpu_parity
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU decoding needs a CUDA device")
def test_gpu_decode_and_gpu_cache_serve_what_the_cpu_decodes(jpeg_shards):
    """nvJPEG batches equal libjpeg-turbo's up to IDCT/upsampling rounding; the GPU cache serves the GPU stream's
    pixels exactly, on the device, in the same global order."""
    dev = torch.device("cuda")

    def by_uq(src):
        return {u: img for b in src.feature_batches(8) for u, img in zip(b.uq.tolist(), _images(b), strict=True)}

    cpu = by_uq(ShardSource(jpeg_shards, ReadOptions(cache="off", decode="cpu", num_workers=0), device=dev))
    gpu_src = ShardSource(jpeg_shards, ReadOptions(cache="off", decode="gpu", num_workers=2), device=dev)
    gpu = by_uq(gpu_src)
    cached_src = ShardSource(jpeg_shards, ReadOptions(cache="gpu", decode="gpu", num_workers=2), device=dev)
    cached = by_uq(cached_src)
    assert cpu.keys() == gpu.keys() == cached.keys() and len(cpu) == 48
    for u in cpu:
        assert gpu[u].device.type == "cuda" and cached[u].device.type == "cuda"
        assert gpu[u].shape == cpu[u].shape and torch.equal(gpu[u], cached[u])
        assert (gpu[u].float() - cpu[u].float()).abs().mean() < 2.0
    assert cached_src._cache.flat.device.type == "cuda"
    a = [b.uq.cpu() for b in gpu_src.train_batches(8, epoch=1, seed=0)]
    b = [b.uq.cpu() for b in cached_src.train_batches(8, epoch=1, seed=0)]
    assert torch.equal(torch.cat(a), torch.cat(b))


def test_the_encoded_bytes_path_serves_what_the_worker_decode_path_serves(jpeg_shards):
    """The GPU-decoding pipeline (workers ship encoded bytes, the main process decodes the whole batch with
    `decode_gpu`) run with the CPU as its device: the same images, sizes and order as decoding in the workers."""
    worker = ShardSource(jpeg_shards, ReadOptions(cache="off", decode="cpu", num_workers=2))
    batched = ShardSource(jpeg_shards, ReadOptions(cache="off", decode="cpu", num_workers=2))
    batched.gpu_decode = True  # decode_gpu(..., device=cpu): the same code path, on the CPU
    for a, b in zip(worker.train_batches(8, 0, 0), batched.train_batches(8, 0, 0), strict=True):
        assert torch.equal(a.uq, b.uq) and torch.equal(a.images, b.images)
        assert (a.sizes is None and b.sizes is None) or torch.equal(a.sizes, b.sizes)


def _cache_worker(rank: int, port: int, shards: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as tdist

    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        src = ShardSource(shards, ReadOptions(cache="cpu", num_workers=0))
        read, original = [], src._read
        src._read = lambda batches, device=None: (
            read.extend(int(r) for b in batches for r in b),
            original(batches, device),
        )[1]
        src.load()
        torch.save({"flat": src._cache.flat, "read": read, "unreadable": src.unreadable()}, f"{out}/rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def test_each_rank_decodes_only_its_share_of_the_cache(shards, tmp_path):
    """Two gloo ranks: each decodes half of the split, then both hold the whole cache (equal to one process's), and
    both know the unreadable sample that only one of them met."""
    import shutil

    import torch.multiprocessing as mp

    from tests.test_kmeans_distributed import _free_port

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    uq = _break_one_image(broken)
    mp.spawn(_cache_worker, args=(_free_port(), str(broken), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = ShardSource(broken, ReadOptions(cache="cpu", num_workers=0))
    single.load()
    assert sorted(res[0]["read"] + res[1]["read"]) == list(range(64)) and len(res[0]["read"]) == 32
    assert torch.equal(res[0]["flat"], single._cache.flat) and torch.equal(res[1]["flat"], single._cache.flat)
    assert res[0]["unreadable"] == res[1]["unreadable"] == single.unreadable() == [uq]

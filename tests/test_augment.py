"""DeviceAugment: crops are windows of the source, flips mirror them, both code paths agree, no jitter = identity."""

from __future__ import annotations

import pytest
import torch

from infosieve_fast.data.reading.augment import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig, DeviceAugment
from infosieve_fast.data.reading.base import Batch
from infosieve_fast.data.reading.pools import BufferPool


def _images(b: int = 6, h: int = 40, w: int = 48) -> torch.Tensor:
    return torch.randint(0, 256, (b, 3, h, w), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def _unnormalise(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1)
    return ((x * std + mean) * 255).round()


@pytest.mark.parametrize("hflip", [True, False])
def test_views_are_crops_and_flips_of_the_source(hflip):
    x = _images()
    aug = DeviceAugment(AugmentConfig(crop_size=32, hflip=hflip))
    views = aug.train_views(x, 2, torch.Generator().manual_seed(1))
    assert views.shape == (12, 3, 32, 32) and views.dtype == torch.float32
    g = torch.Generator().manual_seed(1)  # the same draws, in the documented order: top, left, flip
    top = torch.randint(0, 9, (12,), generator=g)
    left = torch.randint(0, 17, (12,), generator=g)
    flip = torch.rand(12, generator=g) < 0.5 if hflip else torch.zeros(12, dtype=torch.bool)
    got = _unnormalise(views)
    for i in range(12):  # view-major: view i comes from image i % B
        want = x[i % 6, :, top[i] : top[i] + 32, left[i] : left[i] + 32].float()
        if flip[i]:
            want = want.flip(-1)
        torch.testing.assert_close(got[i], want, atol=0, rtol=0)
    assert views[:6].ne(views[6:]).any()  # the two views differ


@pytest.mark.parametrize("jitter", [0.0, 0.4])
def test_cpu_loop_equals_batched_gather(jitter):
    x = _images(8, 64, 70)
    a = DeviceAugment(AugmentConfig(crop_size=56, color_jitter=jitter))
    fast = a.train_views(x, 2, torch.Generator().manual_seed(5))
    a._gather_on_cpu = True
    gathered = a.train_views(x, 2, torch.Generator().manual_seed(5))
    torch.testing.assert_close(fast, gathered, atol=1e-5, rtol=0)


def test_reproducible_and_test_view():
    x = _images()
    aug = DeviceAugment(AugmentConfig(crop_size=32))
    a = aug.train_views(x, 2, torch.Generator().manual_seed(3))
    b = aug.train_views(x, 2, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    t = aug.test_view(x)
    torch.testing.assert_close(_unnormalise(t), x[:, :, 4:36, 8:40].float(), atol=0, rtol=0)


def test_jitter_changes_colours_only_when_on():
    x = _images(4, 32, 32)
    off = DeviceAugment(AugmentConfig(crop_size=32, hflip=False)).train_views(x, 1, torch.Generator().manual_seed(0))
    torch.testing.assert_close(_unnormalise(off), x.float(), atol=0, rtol=0)  # default: the reference's no-op
    on = DeviceAugment(AugmentConfig(crop_size=32, hflip=False, color_jitter=0.4))
    assert not torch.allclose(on.train_views(x, 1, torch.Generator().manual_seed(0)), off)


def test_bad_inputs():
    aug = DeviceAugment(AugmentConfig(crop_size=224))
    with pytest.raises(ValueError, match="smaller than crop_size"):
        aug.train_views(_images(), 2, torch.Generator())
    with pytest.raises(ValueError, match="uint8"):
        aug.test_view(_images().float())


def test_the_sizes_are_read_on_the_host_so_the_host_never_waits_for_the_device():
    """A batch of images of different sizes moved to the `meta` device (shapes without data: reading any value of it
    raises) keeps its sizes on the host, and the test view's checks and shape need no value from the device. Reading
    the sizes' minimum from a device copy, as before, makes the host wait for a CUDA device at every batch."""
    sizes = torch.tensor([[40, 48], [36, 40], [40, 34], [33, 48]])
    n = len(sizes)
    labels = torch.zeros(n, dtype=torch.long)
    batch = Batch(_images(n, 40, 48), labels, torch.arange(n), torch.ones(n, dtype=torch.bool), sizes)
    on_meta = batch.to("meta")
    assert on_meta.images.device.type == "meta" and on_meta.sizes is sizes
    view = DeviceAugment(AugmentConfig(crop_size=32)).test_view(on_meta.images, on_meta.sizes)
    assert view.device.type == "meta" and view.shape == (n, 3, 32, 32)
    with pytest.raises(ValueError, match="an image of 33x34 is smaller than crop_size=34"):  # the least h, the least w
        DeviceAugment(AugmentConfig(crop_size=34)).test_view(on_meta.images, on_meta.sizes)


def test_device_matches_cpu(device):
    x = _images(4, 64, 64)
    aug = DeviceAugment(AugmentConfig(crop_size=48))
    on_dev = aug.train_views(x.to(device), 2, torch.Generator(device=device).manual_seed(2))
    assert on_dev.device.type == device.type and on_dev.shape == (8, 3, 48, 48)
    if device.type == "cpu":
        torch.testing.assert_close(on_dev, aug.train_views(x, 2, torch.Generator().manual_seed(2)))


def test_cpu_outputs_reuse_memory_only_when_released():
    """The CPU path writes into reused buffers (BufferPool): never one whose result, or a view of it, is still held."""
    x = _images(4, 40, 40)
    aug = DeviceAugment(AugmentConfig(crop_size=32))
    gen = torch.Generator().manual_seed(0)
    first = aug.train_views(x, 2, gen)
    kept = first.clone()
    row = first[3]  # a view keeps the buffer alive too
    ptr = first.data_ptr()
    del first
    outs = [aug.train_views(x, 2, gen) for _ in range(3)]  # the pool is full: fresh buffers
    assert torch.equal(row, kept[3]) and all(o.data_ptr() != ptr for o in outs)
    del row, outs
    again = aug.train_views(x, 2, torch.Generator().manual_seed(0))
    assert torch.equal(again, kept)
    del again
    pooled = {buf.data_ptr() for buf, _ in aug._pool._bufs}
    assert aug.train_views(x, 2, gen).data_ptr() in pooled  # released: reused
    test = aug.test_view(x)
    torch.testing.assert_close(_unnormalise(test), x[:, :, 4:36, 4:36].float(), atol=0, rtol=0)


def test_buffer_pool_shapes_and_numpy_holders():
    pool = BufferPool(2)
    a = pool.get((3, 4), torch.float32)
    arr = a.numpy()
    del a
    b = pool.get((3, 4), torch.float32)  # `arr` still holds the first buffer
    assert b.data_ptr() != arr.ctypes.data
    del arr
    c = pool.get((3, 4), torch.float32)
    assert c.data_ptr() != b.data_ptr()
    assert pool.get((2, 2), torch.uint8).shape == (2, 2)  # another shape: a new buffer, the oldest dropped


def test_threaded_cpu_views_equal_serial_and_keep_the_thread_setting():
    """With torch.get_num_threads() > 1 the CPU views are split over Python threads: same output, setting untouched."""
    x = _images(16, 40, 40)
    aug = DeviceAugment(AugmentConfig(crop_size=32))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = aug.train_views(x, 2, torch.Generator().manual_seed(7)).clone()
        torch.set_num_threads(2)
        threaded = aug.train_views(x, 2, torch.Generator().manual_seed(7))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(serial, threaded)

"""nvJPEG failures fall back to the CPU decoder: real CUB JPEGs, the device decode faked to fail (no GPU needed).

`decode.nvjpeg_decode` is the one call that touches nvJPEG; replacing it with one that raises is what a machine
without a working nvJPEG does. The reference is a direct CPU decode of the same bytes (torchvision's libjpeg-turbo,
and PIL's for the decoder-independent check)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_jpeg

from infosieve_fast.config.settings import load_config
from infosieve_fast.data.reading import decode
from infosieve_fast.data.reading.decode import DecodeCounts, decode_gpu
from infosieve_fast.data.reading.stream import ReadOptions, ShardSource
from infosieve_fast.data.writing.shards import make_shards
from infosieve_fast.training.engine import Trainer
from tests.test_engine import SMOKE, _cifar_shards

CLASSES, PER_CLASS = 3, 6
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")  # torchvision 0.29's codecs


@pytest.fixture(scope="module")
def cub_jpegs(realdata) -> list[bytes]:
    """Eight real CUB JPEGs, as stored."""
    root = realdata / "cub100" / "images"
    out = []
    for cls in sorted(os.listdir(root))[:2]:
        out += [(root / cls / f).read_bytes() for f in sorted(os.listdir(root / cls))[:4]]
    return out


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _no_nvjpeg(jpegs, device):
    raise RuntimeError("nvJPEG is not available on this machine (faked)")


def test_a_failed_nvjpeg_call_decodes_the_batch_on_the_cpu(cub_jpegs, monkeypatch):
    monkeypatch.setattr(decode, "nvjpeg_decode", _no_nvjpeg)
    counts = DecodeCounts()
    got = decode_gpu([_tensor(b) for b in cub_jpegs], torch.device("cpu"), counts)
    for img, data in zip(got, cub_jpegs, strict=True):
        assert torch.equal(img, decode_jpeg(_tensor(data)))  # the CPU decode, bit for bit
        pil = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
        assert img.shape == pil.shape and (img.float() - pil.float()).abs().mean() < 1.0  # another decoder agrees
    assert counts.as_dict() == {"cpu": 8, "gpu": 0, "gpu_fallback": 8}
    assert counts.gpu_error == "RuntimeError: nvJPEG is not available on this machine (faked)"


def test_only_an_image_the_cpu_cannot_decode_either_is_lost(cub_jpegs, monkeypatch):
    """nvJPEG's batched call fails as a whole when one image is bad: the rest of the batch still decodes."""
    truncated = cub_jpegs[3][: len(cub_jpegs[3]) // 2]
    batch = [*cub_jpegs[:3], truncated, *cub_jpegs[4:]]

    def fails_on_truncated(jpegs, device):
        if any(len(j) == len(truncated) for j in jpegs):
            raise RuntimeError("nvjpegDecode failed: image incomplete (faked)")
        return [decode_jpeg(j) for j in jpegs]

    monkeypatch.setattr(decode, "nvjpeg_decode", fails_on_truncated)
    counts = DecodeCounts()
    got = decode_gpu([_tensor(b) for b in batch], torch.device("cpu"), counts)
    assert got[3] is None
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert torch.equal(got[i], decode_jpeg(_tensor(batch[i])))
    assert counts.as_dict() == {"cpu": 7, "gpu": 0, "gpu_fallback": 8}
    counts_ok = DecodeCounts()
    decode_gpu([_tensor(b) for b in cub_jpegs[:5]], torch.device("cpu"), counts_ok)  # a good batch: no fallback
    assert counts_ok.as_dict() == {"cpu": 0, "gpu": 5, "gpu_fallback": 0} and counts_ok.gpu_error is None


@pytest.fixture(scope="module")
def cub_shards(realdata, tmp_path_factory):
    """18 real CUB images of 3 species as JPEG shards at shorter side 64."""
    base = tmp_path_factory.mktemp("cub")
    src = realdata / "cub100" / "images"
    for cls in sorted(os.listdir(src))[:CLASSES]:
        (base / "raw" / cls).mkdir(parents=True)
        for f in sorted(os.listdir(src / cls))[:PER_CLASS]:
            os.symlink(src / cls / f, base / "raw" / cls / f)
    make_shards("imagefolder", base / "raw", base / "shards", shard_size_mb=0.05, resize=64, workers=1, progress=False)
    return base / "shards"


def test_the_stream_falls_back_serves_the_cpu_pixels_and_warns_once(cub_shards, monkeypatch, capfd):
    """The GPU-decoding pipeline run with the CPU as its device and nvJPEG faked broken: every batch decodes on the
    CPU, equal to the worker-decoded stream; one warning names the count and the fix; the counts say where."""
    workers = ShardSource(cub_shards, ReadOptions(cache="off", decode="cpu", num_workers=2))
    batched = ShardSource(cub_shards, ReadOptions(cache="off", decode="cpu", num_workers=2))
    batched.gpu_decode = True  # the encoded-bytes path, decoded in this process by decode_gpu
    monkeypatch.setattr(decode, "nvjpeg_decode", _no_nvjpeg)
    n = CLASSES * PER_CLASS
    a, b = list(workers.feature_batches(4)), list(batched.feature_batches(4))
    assert [len(x.uq) for x in b] == [4, 4, 4, 4, 2]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.uq, y.uq) and torch.equal(x.images, y.images)
        assert (x.sizes is None and y.sizes is None) or torch.equal(x.sizes, y.sizes)
    assert batched.unreadable() == [] and batched.decode_counts.as_dict() == {"cpu": n, "gpu": 0, "gpu_fallback": n}
    assert workers.decode_counts.as_dict() == {"cpu": n, "gpu": 0, "gpu_fallback": 0}
    err = capfd.readouterr().err
    assert err.count("nvJPEG failed") == 1 and "a batch of 4 images" in err and "data.decode: cpu" in err


def decode_fields(record: dict) -> tuple:
    keys = ("decoded_cpu", "decoded_gpu", "decoded_gpu_fallback", "decode_cpu_reason")
    return tuple(record[k] for k in keys)


@pytest.mark.parametrize("cache", ["off", "cpu"])
def test_each_epoch_record_counts_the_images_decoded_since_the_last_by_where(tmp_path, realdata, cache):
    """`data.decode=auto` on the CPU: 96 train images, feature batches of 512 and 3 steps of 32 per epoch. Streamed,
    an epoch decodes its feature pass and its steps (96 + 96), and the next record also counts the evaluation run
    between them (96); with the decoded cache, the first pass decodes the split once and nothing after. Every CPU
    decode says why the GPU did not decode."""
    cfg = _cifar_shards(tmp_path, realdata)
    cfg.data.cache = cache
    trainer = Trainer(cfg)
    first = trainer.train_epoch(0)
    trainer.evaluate()
    second = trainer.train_epoch(1)
    reason = "data.decode=auto on a cpu device: the CPU decodes (nvJPEG needs CUDA)"
    if cache == "off":
        assert decode_fields(first) == (96 + 96, 0, 0, reason)
        assert decode_fields(second) == (96 + 96 + 96, 0, 0, reason)
    else:
        assert decode_fields(first) == (96, 0, 0, reason)
        assert decode_fields(second) == (0, 0, 0, None)


def test_an_epoch_whose_nvjpeg_calls_fail_records_the_fallback_and_its_reason(tmp_path, realdata, monkeypatch):
    """The GPU-decoding path run on the CPU with a stand-in nvJPEG that fails its first call (the epoch's only feature
    batch, 96 images) and then decodes (the 3 step batches of 32): the record counts 96 on each decoder, the 96 fallen
    back, and the failure; the next epoch, without failures, counts only GPU decodes and gives no reason."""
    calls = []

    def fails_first(jpegs, device):
        calls.append(len(jpegs))
        if len(calls) == 1:
            raise RuntimeError("nvJPEG is not available on this machine (faked)")
        return [decode_jpeg(j) for j in jpegs]

    monkeypatch.setattr(decode, "nvjpeg_decode", fails_first)
    cfg = _cifar_shards(tmp_path, realdata)
    cfg.data.cache = "off"
    trainer = Trainer(cfg)
    trainer.source.gpu_decode = True  # the encoded-bytes path, decoded in this process by decode_gpu
    first, second = trainer.train_epoch(0), trainer.train_epoch(1)
    assert calls == [96, 32, 32, 32, 96, 32, 32, 32]
    error = "RuntimeError: nvJPEG is not available on this machine (faked)"
    assert decode_fields(first) == (96, 96, 96, f"nvJPEG failed on 96 images ({error}); the CPU decoded them")
    assert decode_fields(second) == (0, 96 + 96, 0, None)


def test_a_source_that_decodes_nothing_records_zero_decodes():
    """The embedded digits are held in memory as pixels: nothing is decoded, on either side."""
    record = Trainer(load_config("configs/demo.yaml", SMOKE + ["train.device=cpu"])).train_epoch(0)
    assert decode_fields(record) == (0, 0, 0, None)

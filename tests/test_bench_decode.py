"""`benchmarks/bench_decode.py` run tiny: the summary, the provenance, the images it decoded. No timing asserts."""

from __future__ import annotations

import json

from benchmarks import bench_decode


def test_summary_and_provenance(tmp_path):
    argv = ["--decode-n", "24", "--decode-batch", "8", "--decode-repeats", "1",
            "--shards-dir", str(tmp_path / "shards"), "--out", str(tmp_path / "decode.json")]  # fmt: skip
    report = bench_decode.main(argv)
    assert set(report["summary"]) == {"decode_augment_images_per_s_per_core"}
    assert list(report)[:4] == ["commit", "dirty", "device", "summary"]
    assert json.loads((tmp_path / "decode.json").read_text()) == json.loads(json.dumps(report))  # printed = written
    assert report["commit"] == "unknown" or len(report["commit"]) == 40
    assert report["dirty"] in (True, False, None) and report["device"].startswith("cpu")
    assert report["summary"]["decode_augment_images_per_s_per_core"] > 0
    assert report["decode_augment"]["images"] == 24

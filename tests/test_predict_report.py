"""After training: `predict` sorts image files with the run's final centres, `report` renders the run as HTML."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.commands.predict import model_from_run
from infosieve_fast.commands.report import node_label
from infosieve_fast.config.settings import load_config
from infosieve_fast.data import digits
from infosieve_fast.data.reading.augment import AugmentConfig, DeviceAugment
from infosieve_fast.training.checkpoint import load_checkpoint
from infosieve_fast.training.run_folder import train
from tests.test_engine import SMOKE


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-epoch demo run and the first 64 of its train images written as PNG files (+ one broken file)."""
    base = tmp_path_factory.mktemp("predict")
    cfg = load_config("configs/demo.yaml", [*SMOKE, "train.device=cpu"])
    train(cfg, base / "run")
    d = cfg.data.digits
    source = digits(d.known_classes, d.labelled_prop, d.split_seed, d.image_size)
    images = base / "images" / "sub"
    images.mkdir(parents=True)
    for uq in range(64):
        Image.fromarray(source.images[uq, 0].numpy()).save(images / f"{uq:04d}.png")
    (images / "zz_broken.png").write_bytes(b"not an image")
    return base, cfg, source


def test_predictions_are_the_nearest_final_centres(run, capsys):
    base, cfg, source = run
    out = base / "pred.jsonl"
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(base / "images"), "--out", str(out),
                     "--device", "cpu"]) == 0  # fmt: skip
    assert "64 predictions" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"].rsplit("/", 1)[1] for r in records] == [f"{uq:04d}.png" for uq in range(64)]
    # independently: the checkpoint's model on the same 36x36 images, centre crop 32, nearest centre
    model, state = model_from_run(base / "run", torch.device("cpu"))
    aug = DeviceAugment(AugmentConfig(cfg.data.crop_size, False, tuple(cfg.data.mean), tuple(cfg.data.std)))
    with torch.no_grad():
        feats = model.features(aug.test_view(source.images[:64]))
    dist = torch.cdist(feats, state["centers"])
    nearest = dist.argmin(1)
    assert [r["cluster"] for r in records] == nearest.tolist()
    top2 = dist.topk(2, largest=False).values
    np.testing.assert_allclose([r["margin"] for r in records], (top2[:, 1] - top2[:, 0]).numpy(), atol=1e-4)
    for r in records:
        want = state["class_names"][r["cluster"]] if r["cluster"] < state["n_old"] else f"novel-{r['cluster']}"
        assert r["name"] == want and len(r["code"]) == cfg.model.code_length
        assert r["code"].startswith(r["prefix"]) and r["tree_path"] == [r["prefix"][: i + 1] for i in
                                                                        range(len(r["prefix"]))]  # fmt: skip
    # the final clustering (clustering.npz) scored these same features: most unlabelled ones agree
    with np.load(base / "run" / "clustering.npz") as z:
        final = dict(zip(z["uq"].tolist(), z["preds"].tolist(), strict=True))
    agree = [final[uq] == nearest[uq].item() for uq in range(64) if uq in final]
    assert len(agree) > 20 and np.mean(agree) >= 0.9


def test_csv_output_and_a_list_file(run, capsys):
    base, _, _ = run
    listing = base / "images" / "list.txt"
    listing.write_text("sub/0003.png\nsub/0001.png\nsub/zz_broken.png\n")
    out = base / "pred.csv"
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(listing), "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "zz_broken.png" in text.err and "1 unreadable image skipped" in text.out
    rows = out.read_text().splitlines()
    assert rows[0] == "path,cluster,name,margin,code,prefix,tree_path" and len(rows) == 3
    assert rows[1].startswith("sub/0003.png,") and rows[2].startswith("sub/0001.png,")
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(listing), "--out", "x.txt"]) == 2


def test_every_image_make_shards_reads_is_sorted_and_other_files_are_counted(run, tmp_path, capsys):
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from infosieve_fast.data.shard_format import IMAGE_SUFFIXES

    assert sorted(IMAGE_SUFFIXES) == sorted(IMG_EXTENSIONS)  # make-shards' imagefolder reads what torchvision reads
    base, _, source = run
    images = tmp_path / "images"
    images.mkdir()
    pixels = Image.fromarray(source.images[5, 0].numpy())
    options = {".jpg": {"quality": 100}, ".jpeg": {"quality": 100}, ".webp": {"lossless": True}}
    for suffix in IMAGE_SUFFIXES:
        pixels.save(images / f"a{suffix}", **options.get(suffix, {}))
    (images / "notes.txt").write_text("not an image")
    (images / "README").write_text("not an image")
    out = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--run", str(base / "run"), "--images", str(images), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {len(IMAGE_SUFFIXES)} predictions" in printed
    assert "2 files skipped as not images (by their suffix: .txt, no suffix)" in printed
    records = {json.loads(line)["path"].rsplit(".", 1)[1]: json.loads(line) for line in out.read_text().splitlines()}
    assert sorted(records) == sorted(s[1:] for s in IMAGE_SUFFIXES)
    # the lossless files hold the same pixels as the PNG: the same cluster and code
    png = records["png"]
    for suffix in ("ppm", "pgm", "bmp", "tif", "tiff", "webp"):
        assert (records[suffix]["cluster"], records[suffix]["code"]) == (png["cluster"], png["code"]), suffix
        assert records[suffix]["margin"] == pytest.approx(png["margin"], abs=1e-5)


def test_report_shows_every_plot_in_a_browser(run, tmp_path, screenshot):
    base, _, _ = run
    report_run = tmp_path / "run"
    shutil.copytree(base / "run", report_run)
    assert cli.main(["tree", "--run", str(report_run), "--depth", "4"]) == 0
    tree = json.loads((report_run / "tree.json").read_text())
    names = load_checkpoint(report_run)["class_names"]
    assert tree["class_names"] == names  # the report labels the nodes by name
    node = max(tree["children"], key=lambda c: c["n"])
    top = max(range(len(names)), key=lambda c: node["classes"].get(str(c), 0))
    assert node_label(node, tree["class_names"]).split("\n")[1] == names[top][:14]
    assert cli.main(["report", "--run", str(report_run)]) == 0
    page = (report_run / "report.html").read_text()
    pngs = sorted(p.name for p in (report_run / "report").glob("*.png"))
    assert pngs == ["accuracy.png", "confusion.png", "losses.png", "schedules.png", "tree.png"]
    assert page.count("data:image/png;base64,") == 5 and "<td>after</td>" in page
    shot = screenshot(report_run / "report.html", tmp_path / "shot.png", 1300, 4200)
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    rows_with_ink = (np.abs(pixels - 255).sum(-1) > 60).any(1)
    assert rows_with_ink.mean() > 0.5  # the plots fill the page, not a blank or broken-image page
    colourful = (pixels.max(-1) - pixels.min(-1) > 80).mean()
    assert colourful > 0.01  # the coloured curves, the confusion matrix and the tree's nodes are drawn


def test_tree_node_label_names_the_majority_class_after_json():
    node = json.loads(json.dumps({"prefix": "01", "n": 9, "classes": {10: 2, 2: 7}}))  # keys become strings
    names = [f"species {c:03d} with a long name" for c in range(12)]
    assert node_label(node, names) == "01\nspecies 002 wi\nn=9"
    assert node_label(node, None) == "01\n2\nn=9"
    assert node_label({"prefix": "", "n": 0, "classes": {}}, names) == "root\nno labels\nn=0"

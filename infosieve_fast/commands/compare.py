"""`infosieve compare RUN_OR_SWEEP ... [--out page.html] [--json FILE] [--reference DATASET]`: runs and sweeps side
by side, as tables (printed, and in one self-contained HTML page built like `infosieve report`'s) and as curves over
the epochs.

- An entry is a run folder, or one grid point of a sweep (its seeds' finished runs together: mean ± sd, the sample
  standard deviation). Every number is the last checkpoint's (`run_results`); each entry says so.
- Entries are grouped by their setting: the data (the dataset of the shards' manifest.json, its classes and train
  images, whether it is the full official split) and the backbone with its weights file. Each setting has its own
  tables, so numbers made on one setting never share a column with another's.
- The paper's published rows (InfoSieve, and the GCD and SimGCD rows it compares against: data/published_results.yaml,
  with the paper and table named) are rows of a setting's table only in the paper's setting: one of its datasets, the
  full official split, ViT-B/16 with the DINO weights. For a paper dataset in another setting, and for each
  `--reference DATASET`, they are a table of their own.
- Beside them, each method that an entry trains (`method:`) gets its own paper's row for the dataset, where that paper
  reports it (data/method_papers.yaml, with where each number was checked): a GCD, SimGCD or SelEx run is read against
  the numbers of the method it runs. InfoSieve's own paper is the published rows above.
- Runs whose environment fingerprints differ in a way that changes numerics (`fingerprint.numerics_differences`,
  fingerprint.json and every resume's environment) are flagged.
"""

from __future__ import annotations

import argparse
import functools
import html
import json
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

import numpy as np
import yaml

from ..analysis.run_results import PARTS, RunResult, format_spread, markdown_table, read_run, summarise_runs
from ..common.files import write_json
from ..config.settings import Config
from ..training import fingerprint
from .report import accuracy_points, figure_html, html_page, pyplot, series
from .sweep import is_done, point_label, read_plan, run_config, run_dir

PROTOCOLS = ("v2", "v1", "v2b")


# ------------------------------------------------------------------------------------------------ the entries
@dataclass
class Entry:
    label: str
    origin: str  # the run folder, or the sweep folder and grid point
    runs: list[RunResult]  # its finished runs (the numbers)
    unfinished: list[str] = field(default_factory=list)  # its runs without metrics.json yet
    setting: dict = field(default_factory=dict)
    method: str = "infosieve"  # the `method:` its runs train

    @cached_property
    def stats(self) -> dict:
        return summarise_runs(self.runs)


def load_entries(paths: list[str | Path]) -> list[Entry]:
    """One entry per run folder and per grid point of each sweep folder, in the order given."""
    entries = []
    for path in map(Path, paths):
        if (path / "sweep.json").is_file():
            entries += sweep_entries(path)
        elif (path / "config.yaml").is_file():
            run = read_run(path)
            entry = Entry(path.name, str(path), [], setting=run_setting(run.cfg), method=run.cfg.method)
            if run.finished:
                entry.runs.append(run)
            else:
                entry.unfinished.append(str(path))
            entries.append(entry)
        else:
            raise FileNotFoundError(
                f"{path} is neither a run folder (config.yaml) nor a sweep folder (sweep.json): pass folders written "
                "by `infosieve train` or `infosieve sweep`"
            )
    if len({e.label for e in entries}) < len(entries):  # two runs of one name: name them by their paths
        for e in entries:
            e.label = e.origin
    return entries


def sweep_entries(sweep_dir: Path) -> list[Entry]:
    plan = read_plan(sweep_dir)
    entries: dict[str, Entry] = {}
    for run in plan["runs"]:
        label = f"{sweep_dir.name}: {point_label(run['point'])}"
        cfg = run_config(plan, run)
        origin = f"{sweep_dir} ({point_label(run['point'])})"
        entry = entries.setdefault(label, Entry(label, origin, [], setting=run_setting(cfg), method=cfg.method))
        if is_done(sweep_dir, run):
            entry.runs.append(read_run(run_dir(sweep_dir, run)))
        else:
            entry.unfinished.append(str(run_dir(sweep_dir, run)))
    return list(entries.values())


# ------------------------------------------------------------------------------------------------ the setting
@functools.cache
def published() -> dict:
    """data/published_results.yaml: the paper, its setting, and the tables' rows."""
    return yaml.safe_load((resources.files("infosieve_fast.data") / "published_results.yaml").read_text())


@functools.cache
def method_papers() -> dict:
    """data/method_papers.yaml: each method's own paper, its rows and where they were checked, by `method:` value."""
    return yaml.safe_load((resources.files("infosieve_fast.data") / "method_papers.yaml").read_text())["methods"]


def paper_datasets() -> dict[str, dict]:
    """{dataset: the published table holding it}."""
    return {d: table for table in published()["tables"] for d in table["datasets"]}


def describe_data(cfg: Config) -> dict:
    """{"dataset", "text", "full"}: what a run trains on. `full`: the full official dataset with GCD's split (the
    shards' manifest.json found its counts equal to docs/reference.md §7's), and every train sample used."""
    d = cfg.data
    if d.source == "digits":
        text, dataset, full = f"the scikit-learn digits ({d.digits.known_classes} of 10 classes known)", "digits", False
    else:
        manifest_path = Path(d.shards) / "manifest.json" if isinstance(d.shards, str) else None
        if manifest_path is None or not manifest_path.is_file():
            return {
                "dataset": "unknown",
                "full": False,
                "text": f"the shards {d.shards} (no manifest.json there: the dataset is unknown)",
            }
        m = json.loads(manifest_path.read_text())
        dataset, full = m["dataset"], m.get("reference_check") == "ok"
        classes = "unknown" if m.get("n_classes") is None else m["n_classes"]
        text = f"{dataset} ({classes} classes, {m['counts']['train']:,} train images"
        text += ", the full official split)" if full else ", not the full official split)"
    if cfg.train.train_subset is not None:
        text, full = text + f", its first {cfg.train.train_subset:,} train samples only", False
    return {"dataset": dataset, "text": text, "full": full}


def run_setting(cfg: Config) -> dict:
    """The data and the backbone a run's numbers are made on, and whether that is the paper's setting."""
    data = describe_data(cfg)
    weights = Path(cfg.model.pretrained).name if cfg.model.pretrained else None
    paper = published()["setting"]
    in_paper = (
        data["dataset"] in paper_datasets()
        and data["full"]
        and cfg.model.backbone == paper["backbone"]
        and weights == paper["weights"]
    )
    backbone = f"{cfg.model.backbone} ({weights or 'no pretrained weights'})"
    return {
        "dataset": data["dataset"],
        "data": data["text"],
        "backbone": backbone,
        "paper_setting": in_paper,
        "label": f"{backbone} on {data['text']}",
    }


# ------------------------------------------------------------------------------------------------ the tables
@dataclass
class Table:
    title: str
    notes: list[str]
    header: list[str]
    rows: list[list[str]]


def percent(stats: dict | None) -> str:
    """An accuracy spread in % (as the paper writes them), mean ± sd."""
    if stats is None:
        return "—"
    scaled = {k: v * 100 if k != "n" and v is not None else v for k, v in stats.items()}
    return format_spread(scaled, 1, with_range=False)


def seeds_cell(e: Entry) -> str:
    done = len(e.runs)
    return f"{done}" if not e.unfinished else f"{done} of {done + len(e.unfinished)}"


def published_rows(dataset: str) -> tuple[dict, list[list[str]]]:
    """(the table it comes from, its rows as cells: method, source, All, Known, Novel)."""
    table = paper_datasets()[dataset]
    rows = []
    for method, values in table["rows"].items():
        source = f"published: {table['table']} of the InfoSieve paper ({published()['methods'][method]})"
        numbers = [f"{v:.1f}" for v in values[dataset]] if values[dataset] else ["not reported"] * 3
        rows.append([f"{method} (published)", source, *numbers])
    return table, rows


def own_paper_rows(dataset: str, methods: list[str]) -> tuple[list[list[str]], list[str]]:
    """(the rows of `methods`' own papers for `dataset` as cells: method, source, All, Known, Novel; a note per
    method saying where its numbers were checked or that its paper's row for the dataset is not here), in
    `method:` order; InfoSieve's own rows are the published tables'."""
    rows, notes = [], []
    papers = method_papers()
    for paper in (papers[m] for m in papers if m in methods):
        values = paper["rows"].get(dataset)
        if values is None:
            notes.append(f"{paper['name']}'s own paper: no {dataset} row is transcribed here ({paper['paper']}).")
            continue
        numbers = ["not transcribed" if v is None else f"{v:.1f}" for v in values]
        rows.append([f"{paper['name']} (its own paper)", f"published: {paper['paper']}", *numbers])
        notes.append(f"{paper['name']} (its own paper): {paper['checked']}")
    return rows, notes


def accuracy_table(setting: dict, entries: list[Entry]) -> Table:
    header = ["entry", "source", "seeds"] + [f"{p} {part.capitalize()} (%)" for p in PROTOCOLS for part in PARTS]
    rows = [
        [e.label, e.origin, seeds_cell(e)]
        + [percent(e.stats["accuracy"][p][part]) for p in PROTOCOLS for part in PARTS]
        for e in entries
    ]
    notes = [
        f"Setting: {setting['label']}.",
        "All / Old / New of the unlabelled train samples after training, "
        "mean ± sd over the seeds (sample sd, n − 1), from each run's last checkpoint.",
    ]
    if setting["paper_setting"]:
        table, published_cells = published_rows(setting["dataset"])
        own, own_notes = own_paper_rows(setting["dataset"], [e.method for e in entries])
        rows = [[*row[:2], "—", *row[2:], *["—"] * 6] for row in published_cells + own] + rows  # no seeds, v2 only
        notes.append(
            reference_note(setting["dataset"], table)
            + " This is the paper's setting: its rows are comparable with the runs'."
        )
        notes += own_notes
    return Table(f"{setting['label']}: accuracy", notes, header, rows)


def reference_note(dataset: str, table: dict) -> str:
    pub = published()
    absent = "; ".join(f"{k}: {v}" for k, v in pub["not_in_paper"].items())
    return (
        f'Published rows: {pub["paper"]}, {table["table"]} ({table["label"]}: "{table["caption"]}"), '
        f"{table['datasets'][dataset]} columns; {pub['setting']['description']}; protocol {pub['protocol']}. "
        f"{absent}."
    )


def reference_table(dataset: str, methods: list[str] = ()) -> Table:
    """The published rows alone (and `methods`' own papers' rows), for a paper dataset no entry is in the paper's
    setting for."""
    table, rows = published_rows(dataset)
    own, own_notes = own_paper_rows(dataset, methods)
    rows += own
    header = ["method", "source", "All (%)", "Known (%)", "Novel (%)"]
    notes = [reference_note(dataset, table), *own_notes]
    notes.append("Not comparable with any run above: none of them is in this setting.")
    return Table(f"Published: {table['datasets'][dataset]} (the paper's setting)", notes, header, rows)


CODE_COLUMNS = (
    ("all", "code All", 4),
    ("purity_8", "depth-8 purity", 4),
    ("nmi_8", "depth-8 NMI", 4),
    ("mean_length", "mean code length", 1),
)


def detail_table(setting: dict, entries: list[Entry], environment: dict[str, str]) -> Table:
    header = (
        ["entry", "seeds"]
        + [name for _, name, _ in CODE_COLUMNS]
        + ["s/epoch", "peak memory (MiB)", "checkpoint", "environment"]
    )
    rows = []
    for e in entries:
        s = e.stats
        memory = format_spread(s["peak_memory_mib"], 0, with_range=False)
        if s["peak_memory_kind"]:
            memory += f" ({s['peak_memory_kind']})"
        checkpoints = sorted({r.checkpoint for r in e.runs}) or ["—"]
        env = sorted({environment[str(r.path)] for r in e.runs}) or ["—"]
        rows.append(
            [e.label, seeds_cell(e)]
            + [code_cell(e, k, digits) for k, _, digits in CODE_COLUMNS]
            + [
                format_spread(s["seconds_per_epoch"], 1, with_range=False),
                memory,
                "; ".join(checkpoints),
                "; ".join(env),
            ]
        )
    notes = [
        "The codes: SS-k-means on the binary codes and the code prefixes at depth 8 (RUN/tree.json). "
        "s/epoch: log.jsonl's mean seconds per epoch; peak memory: the largest epoch's."
    ]
    notes += [tree_note(r) for e in entries for r in e.runs if r.codes_note]
    return Table(f"{setting['label']}: codes, time, memory", notes, header, rows)


def code_cell(e: Entry, key: str, digits: int) -> str:
    """The code measure `key` over the entry's runs whose tree.json is of their checkpoint; "stale" when every one
    with a tree.json has a stale one."""
    value = e.stats["codes"].get(key)
    if value is None and any(r.codes is None and r.codes_note for r in e.runs):
        return "stale (see the note)"
    return format_spread(value, digits, with_range=False)


def tree_note(run: RunResult) -> str:
    """Why a run's tree.json numbers are left out of the code columns (stale), or shown with an unknown age."""
    shown = "left out of the code columns" if run.codes is None else "in the code columns, of unknown age"
    return f"{run.name}: {shown}: {run.codes_note}"


def settings_of(entries: list[Entry]) -> list[tuple[dict, list[Entry]]]:
    groups: dict[str, tuple[dict, list[Entry]]] = {}
    for e in entries:
        groups.setdefault(e.setting["label"], (e.setting, []))[1].append(e)
    return list(groups.values())


def tables(entries: list[Entry], references: list[str], environment: dict[str, str]) -> list[Table]:
    """Per setting: its accuracy table (with the published rows in the paper's setting) and its detail table; then
    the published rows alone for every paper dataset run outside the paper's setting or named by `references`."""
    unknown = sorted(set(references) - set(paper_datasets()))
    if unknown:
        raise ValueError(f"--reference {', '.join(unknown)}: the paper reports {', '.join(paper_datasets())}")
    out, shown = [], set()
    groups = settings_of(entries)
    for setting, group in groups:
        out += [accuracy_table(setting, group), detail_table(setting, group, environment)]
        if setting["paper_setting"]:
            shown.add(setting["dataset"])
    wanted = [s["dataset"] for s, _ in groups if s["dataset"] in paper_datasets()] + list(references)
    for dataset in dict.fromkeys(wanted):
        if dataset not in shown:
            methods = [e.method for s, group in groups if s["dataset"] == dataset for e in group]
            out.append(reference_table(dataset, methods))
    return out


# ------------------------------------------------------------------------------------------------ environments
def environment_flags(entries: list[Entry]) -> tuple[dict[str, str], list[str]]:
    """({run path: its environment cell}, the lines that flag numerics differences): every run's fingerprint.json
    against the first run's that has one, and every resume recorded in an environment that differs from the run's."""
    runs = [r for e in entries for r in e.runs]
    prints = {str(r.path): fingerprint.read(r.path) for r in runs}
    reference = next((p for p in prints if prints[p] is not None), None)
    cells, lines = {}, []
    for path, fp in prints.items():
        if fp is None:
            cells[path] = "unknown (no fingerprint.json)"
            lines.append(f"{path}: no fingerprint.json (the run predates fingerprints): its environment is unknown")
            continue
        differences = [] if path == reference else fingerprint.numerics_differences(prints[reference], fp)
        resumed = [(r["epoch"], r["differences"]) for r in fingerprint.resume_environments(path) if r["differences"]]
        cells[path] = "differs" if differences or resumed else "reference" if path == reference else "same numerics"
        if differences:
            lines.append(f"{path} vs {reference}: " + "; ".join(differences))
        lines += [
            f"{path}: resumed at epoch {epoch} in an environment whose numerics differ: " + "; ".join(d)
            for epoch, d in resumed
        ]
    return cells, lines


# ------------------------------------------------------------------------------------------------ the curves
def entry_curve(runs: list[RunResult], points) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Epochs, and the mean, min and max over `runs` of `points(run)` ([(epoch, value)]) at each epoch."""
    by_epoch: dict[int, list[float]] = {}
    for run in runs:
        for epoch, value in points(run):
            by_epoch.setdefault(epoch, []).append(value)
    epochs = sorted(by_epoch)
    values = [np.asarray(by_epoch[e], dtype=np.float64) for e in epochs]
    return epochs, *(np.asarray([f(v) for v in values]) for f in (np.mean, np.min, np.max))


def log_points(key: str, part: str | None = None):
    return lambda run: list(zip(*series(run.log, key, part), strict=True))


CURVES = (
    ("loss_total", None, "total loss"),
    ("kmeans_inertia", None, "k-means inertia"),
    ("seconds", None, "seconds per epoch"),
    ("eval_codes", "all", "code All (train.eval_every)"),
    ("eval_codes", "purity_8", "depth-8 purity (train.eval_every)"),
)


def plot_panels(entries: list[Entry], panels: list[tuple[str, object]], path: Path, ylim=None) -> None:
    """One panel per (title, points) with one curve per entry: the mean over its runs, shaded from min to max."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, (title, points) in zip(axes[0], panels, strict=True):
        for i, e in enumerate(entries):
            epochs, mean, low, high = entry_curve(e.runs, points)
            if not epochs:
                continue
            ax.plot(epochs, mean, color=f"C{i % 10}", lw=2.5, marker="o", ms=4, label=e.label)
            if len(e.runs) > 1:
                ax.fill_between(epochs, low, high, color=f"C{i % 10}", alpha=0.15, lw=0)
        ax.set(title=title, xlabel="epoch", ylim=ylim)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_figures(entries: list[Entry], folder: Path) -> list[tuple[Path, str]]:
    """The accuracy curves (before, every `train.eval_every` epochs, after) and the log's curves, as PNGs."""
    folder.mkdir(parents=True, exist_ok=True)
    accuracy = [
        (
            f"{part.capitalize()} (run's protocol; 0 = before training)",
            lambda run, part=part: accuracy_points(run.log, run.metrics, part),
        )
        for part in PARTS
    ]
    present = [
        (title, log_points(key, part))
        for key, part, title in CURVES
        if any(series(r.log, key, part)[0] for e in entries for r in e.runs)
    ]
    figures = [
        (folder / "accuracy.png", "All / Old / New over the epochs: mean over seeds, shaded min to max"),
        (folder / "training.png", "the log's curves: mean over seeds, shaded min to max"),
    ]
    plot_panels(entries, accuracy, figures[0][0], ylim=(0, 1))
    plot_panels(entries, present, figures[1][0])
    return figures


# ------------------------------------------------------------------------------------------------ the outputs
def table_markdown(t: Table) -> str:
    return "\n".join([f"## {t.title}", "", *t.notes, "", markdown_table(t.header, t.rows), ""])


def table_html(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in t.notes)
    return f"<h2>{html.escape(t.title)}</h2>{notes}<table><tr>{head}</tr>{rows}</table>"


def flags_html(flags: list[str]) -> str:
    if not flags:
        return "<p>Every run's environment has the same numerics.</p>"
    items = "".join(f"<li>{html.escape(f)}</li>" for f in flags)
    return f"<h2>Environments whose numerics differ</h2><ul>{items}</ul>"


def comparison_json(entries: list[Entry], shown: list[Table], flags: list[str]) -> dict:
    return {
        "entries": [
            {
                "label": e.label,
                "origin": e.origin,
                "setting": e.setting,
                "runs": [r.record() for r in e.runs],
                "unfinished": e.unfinished,
                **e.stats,
            }
            for e in entries
        ],
        "tables": [{"title": t.title, "notes": t.notes, "header": t.header, "rows": t.rows} for t in shown],
        "environment_flags": flags,
        "statistics": (
            "mean, sd, min and max over an entry's finished runs; sd is the sample standard deviation "
            "(n - 1 in the denominator)"
        ),
    }


def compare(paths: list[str | Path], out: str | Path, references: list[str] = (), json_out=None) -> dict:
    """Write the page (and the JSON); returns the JSON's content."""
    entries = load_entries(paths)
    environment, flags = environment_flags(entries)
    shown = tables(entries, list(references), environment)
    out = Path(out)
    figures = write_figures(entries, out.parent / out.stem)
    unfinished = [u for e in entries for u in e.unfinished]
    notes = [f"not finished (left out of the numbers): {', '.join(unfinished)}"] if unfinished else []
    body = (
        "<h1>infosieve compare</h1>"
        + "".join(f"<p><em>{html.escape(n)}</em></p>" for n in notes)
        + "".join(table_html(t) for t in shown)
        + flags_html(flags)
        + "".join(figure_html(p, caption) for p, caption in figures)
    )
    out.write_text(html_page("infosieve compare", body))
    result = comparison_json(entries, shown, flags)
    if json_out:
        write_json(json_out, result)
    print("\n".join([*notes, *(table_markdown(t) for t in shown)]))
    print("\n".join(["environments whose numerics differ:", *flags]) if flags else "environments: same numerics")
    print(f"wrote {out}" + (f" and {json_out}" if json_out else ""))
    return result


def run_cli(args: argparse.Namespace) -> int:
    compare(args.paths, args.out, args.reference, args.json)
    return 0

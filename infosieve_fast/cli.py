"""`infosieve train | eval | tree | predict | report | name | export | estimate-k | make-shards | sweep | compare`."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path

from .common import distributed
from .common.files import DiskWriteError
from .common.shown_text import terminal_safe
from .config import settings as config_mod
from .data.writing import shards
from .training.loss_monitor import NonFiniteLoss
from .training.preemption import PREEMPTED_EXIT, Preempted, StopSignals
from .training.run_source import SOURCE_FLAG, refuse_fetches, typed_source

AUTO = "auto"  # `--resume auto`: what a relaunched command line (torchrun --max-restarts, a requeued job) passes


class UsageError(ValueError):
    """A command line that cannot work: printed as `error: ...`, exit status 2."""


def _train(args: argparse.Namespace) -> int:
    from .training.run_folder import train

    overrides = list(args.set)
    if args.data_shards:
        overrides.append(f"data.shards={args.data_shards}")
    if args.resume and args.resume != AUTO:
        if args.config or args.out:
            raise UsageError("--resume RUN_DIR continues a run with its own config.yaml: drop --config/--out")
        run_dir = Path(args.resume)
        cfg_path = run_dir / "config.yaml"
        if not cfg_path.is_file():
            raise FileNotFoundError(
                f"--resume {run_dir}: no config.yaml there; pass the run folder an `infosieve train` run wrote "
                "(it printed `run folder: ...`; by default runs/<config>-<timestamp>)"
            )
        # --set on resume changes the run on purpose: recorded in RUN/resumes.jsonl and config.yaml
        cfg = config_mod.load_config(cfg_path, overrides, saved=True)
        typed = any(o.partition("=")[0].strip() == "data.shards" for o in overrides)
        refuse_fetches(cfg, run_dir, shards_typed=typed)  # a run folder runs no command and fetches nothing of its own
        _interruptible(lambda: train(cfg, run_dir, resume=True, overrides=overrides), run_dir)
        return 0
    if not args.config:
        raise UsageError("train needs --config FILE (see configs/) or --resume RUN_DIR")
    cfg = config_mod.load_config(args.config, overrides)
    from .training.trainer_setup import started_run

    with started_run(cfg.train.device) as device:  # torchrun: every rank, one run folder
        stamp = distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))
        run_dir = Path(args.out) if args.out else Path("runs") / f"{Path(args.config).stem}-{stamp}"
        resume = args.resume == AUTO and _resume_automatically(cfg, args, run_dir)
        _interruptible(lambda: train(cfg, run_dir, resume=resume, device=device), run_dir)
    return 0


def _resume_automatically(cfg: config_mod.Config, args: argparse.Namespace, run_dir: Path) -> bool:
    """`--resume auto`: whether `run_dir` holds a checkpoint of this very config (then the run goes on, as a launch
    restarted by torchrun or requeued by a scheduler wants); False for a folder without one (a fresh start). A
    checkpoint of another config is an error. Rank 0 decides for every rank (a new run writes the folder)."""
    if not args.out:
        raise UsageError("--resume auto needs --out RUN_DIR: the folder a restarted launch finds its run in")
    answer: tuple[bool, str | None] = (False, None)
    if distributed.is_main_process() and (run_dir / "checkpoint.pt").is_file():
        saved = config_mod.load_config(run_dir / "config.yaml", saved=True)
        drift = config_mod.config_drift(saved.to_dict(), cfg.to_dict())
        listed = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in drift.items())
        problem = (
            f"--resume auto: {run_dir} holds a run of another config ({listed}); choose another --out, or "
            f"continue that run with `infosieve train --resume {run_dir}`"
        )
        answer = (not drift, problem if drift else None)
    resume, problem = distributed.broadcast_object(answer)
    if problem:
        raise config_mod.ConfigError(problem)
    return resume


def _interruptible(run, run_dir: Path) -> None:
    """Ctrl-C ends a training with the way back in, not a traceback."""
    try:
        run()
    except Preempted as stopped:  # SIGTERM or SIGUSR1: the checkpoint is written, the way back named
        if distributed.is_main_process():
            print(f"preempted: {stopped}", file=sys.stderr)
        raise SystemExit(PREEMPTED_EXIT) from None
    except NonFiniteLoss as err:  # the run folder holds the last good checkpoint: the message says what to change
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except DiskWriteError as err:  # the last durable checkpoint and log stay readable: say so, no traceback
        print(
            f"error: {err}. Free space (or make the folder writable), then continue with "
            f"`infosieve train --resume {run_dir}`",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the last finished epoch's checkpoint is in {run_dir}; continue with "
            f"`infosieve train --resume {run_dir}`",
            file=sys.stderr,
        )
        raise SystemExit(130) from None  # the shell's status for a run ended by Ctrl-C


def _eval(args: argparse.Namespace) -> int:
    from .analysis.run_reader import assignment_centers, read_run
    from .training.run_folder import print_table

    trainer, read = read_run(args.run, args.checkpoint)
    print(f"checkpoint: {read}")
    if args.split == "test":
        centers = assignment_centers(trainer, args.run, args.checkpoint)
        metrics = trainer.evaluator.evaluate_test(centers, trainer.cfg.data.shards)
    else:
        metrics = trainer.evaluate()
    print_table({f"{args.checkpoint} ({args.split})": metrics}, trainer.cfg.train.eval_protocol)
    if args.split == "train" and trainer.model.labeller is not None:  # what the codes hold, on the same samples
        from .evaluation.code_metrics import evaluate_codes, format_code_measures

        print(format_code_measures(evaluate_codes(trainer.evaluator)))
    return 0


def _tree(args: argparse.Namespace) -> int:
    from .analysis.run_reader import code_tree
    from .common.files import write_json
    from .evaluation.code_metrics import format_code_measures
    from .evaluation.tree import format_tree

    tree = code_tree(args.run, args.depth, args.checkpoint)
    print(f"checkpoint: {tree['checkpoint']}")
    default = "tree.json" if args.checkpoint == "last" else "tree-best.json"  # the last's tree stays where it was
    out = Path(args.json) if args.json else Path(args.run) / default
    write_json(out, tree)
    print("\n".join(map(terminal_safe, format_tree(tree).split("\n"))))  # class names come from the data
    print(format_code_measures(tree["measures"]))
    if tree.get("novel_clusters"):
        from .analysis.cluster_places import place_text
        from .evaluation.code_separation import separation_text

        print(separation_text(tree["code_separation"]))
        print("novel clusters:")
        print("\n".join(f"  {terminal_safe(place_text(place))}" for place in tree["novel_clusters"]))
    print(f"wrote {out}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from .commands.predict import predict
    from .common.wording import counted
    from .data.shard_format import IMAGE_SUFFIXES

    summary = predict(
        args.run, args.images, args.out, batch_size=args.batch_size, device=args.device, checkpoint=args.checkpoint
    )
    print(f"checkpoint: {summary['checkpoint']}")
    print(
        f"wrote {counted(summary['written'], 'prediction')} to {summary['out']} "
        f"({counted(summary['skipped'], 'unreadable image')} skipped; {counted(summary['clusters_used'], 'cluster')} "
        "used)"
    )
    if summary["not_images"]:
        print(
            f"{counted(summary['not_images'], 'file')} skipped as not images (by their suffix: "
            f"{terminal_safe(', '.join(summary['not_image_suffixes']))}); images end in {', '.join(IMAGE_SUFFIXES)}"
        )
    if summary["run_clustered"]:
        print(
            f"{summary['run_clustered']} of them the run itself clustered: each keeps the run's final cluster "
            "(RUN/clustering.npz); the others went to their nearest centre"
        )
    return 0


def _report(args: argparse.Namespace) -> int:
    from .commands.report import write_report

    print(f"wrote {write_report(args.run, depth=args.depth, checkpoint=args.checkpoint)}")
    return 0


def _name(args: argparse.Namespace) -> int:
    from .analysis.cluster_names import NAMES, assign_names
    from .training.checkpoint import load_checkpoint

    state = load_checkpoint(args.run)
    if state.get("centers") is None:
        raise ValueError(f"{args.run} has no final clustering yet (its checkpoint holds no centres): let it finish")
    names = assign_names(args.run, args.names, list(state["class_names"]), len(state["centers"]))
    print("\n".join(f"novel-{k} = {name}" for k, name in sorted(names.items())))
    print(f"wrote {Path(args.run) / NAMES}")
    return 0


def _export(args: argparse.Namespace) -> int:
    import json

    from .commands.export import export_run

    print(json.dumps(export_run(args.run, args.out)))
    return 0


def _estimate_k(args: argparse.Namespace) -> int:
    import json

    from .evaluation.estimate_k import describe_choice, estimate_k, k_warning, load_features

    if bool(args.run) == bool(args.features):
        raise UsageError("estimate-k needs exactly one of --run RUN_DIR or --features FILE.npz")
    if args.rule != "score" and (args.k_max is not None or args.seeds is not None):
        raise UsageError("--k-max and --seeds set the score's search: add --rule score, or drop them")
    if args.run and args.known_classes is not None:
        raise UsageError("--known-classes goes with --features; a run knows its known classes: drop --known-classes")
    if args.features:
        if args.known_classes is None:
            raise UsageError("--features needs --known-classes C (classes 0..C-1 are known, half of them labelled)")
        if not Path(args.features).is_file():
            raise UsageError(f"--features {args.features}: no such file; pass an .npz with F [N, D] and y [N]")
        if args.known_classes < 2:
            raise UsageError(
                f"--known-classes {args.known_classes}: estimating K needs at least 2 known classes (with one, K = 1 "
                "always scores best): pass --known-classes 2 or more"
            )
        feats, targets, labelled = load_features(args.features, args.known_classes)
        n_old = args.known_classes
    else:
        from .analysis.run_reader import trainer_from_run

        trainer = trainer_from_run(args.run)
        fs = trainer.evaluator.features("test")
        feats, targets, labelled = fs.feats.cpu().numpy(), fs.targets.cpu().numpy(), fs.labelled.cpu().numpy()
        n_old = trainer.source.n_old
    result = estimate_k(
        feats,
        targets,
        labelled,
        n_old,
        rule=args.rule,
        k_max=args.k_max,
        progress=lambda msg: print(msg, file=sys.stderr),
        **({} if args.seeds is None else {"n_seeds": args.seeds}),
    )
    print(f"K = {result['k']}: {describe_choice(result)}", file=sys.stderr)
    if args.run:
        from .evaluation.feature_view import describe_feature_view

        served = getattr(trainer.source, "size", None)
        print(describe_feature_view(trainer.augment.cfg.crop_size, served), file=sys.stderr)
    warning = k_warning(result)
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def _make_shards(args: argparse.Namespace) -> int:
    """make-shards, ended by SIGTERM or SIGUSR1 with one line: its encoders end with it (left alone, each would print
    a broken pipe's traceback), and the next run goes on after the last finished shard."""
    try:
        with StopSignals():
            return shards.run_cli(args)
    except Preempted as stopped:
        print(f"make-shards: {stopped}; the finished shards are kept: run the same command to go on", file=sys.stderr)
        return PREEMPTED_EXIT


def _sweep(args: argparse.Namespace) -> int:
    from .commands.sweep import run_cli

    return run_cli(args)


def _compare(args: argparse.Namespace) -> int:
    from .commands.compare import run_cli

    return run_cli(args)


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    """`--data.shards` for a command that rebuilds a run's train set from its recorded source (run_source.py)."""
    parser.add_argument(
        SOURCE_FLAG,
        dest="data_shards",
        metavar="SHARDS",
        help="the run's train shards, in place of the recorded data.shards (a recorded pipe: or http(s):// source "
        "is used only when named here)",
    )


def add_run_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--run",
        required=True,
        metavar="RUN_DIR",
        help=f"the run folder `infosieve train` wrote (it printed it): {what}",
    )


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        choices=("last", "best"),
        default="last",
        help="last: RUN/checkpoint.pt (default); best: RUN/checkpoint-best.pt, the best epoch by the "
        "run's checkpoint.best criterion",
    )


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (configs/*.yaml)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. optim.lr=0.05 (on --resume: a recorded change)",
    )
    p.add_argument("--data.shards", dest="data_shards", help="shard folder (same as --set data.shards=DIR)")
    p.add_argument("--out", help="run folder (default runs/<config>-<timestamp>)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its last checkpoint (from scratch if it has none yet); `--resume auto` with --config "
        "and --out: continue the run in --out when it holds one of the same config, else start it",
    )


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    add_run_argument(p, "its checkpoint is scored")
    p.add_argument(
        "--split",
        choices=("train", "test"),
        default="train",
        help="train: SS-k-means of the unlabelled train samples (the reported metric); test: the held-out "
        "test split, each image to the nearest final centre",
    )
    add_source_argument(p)
    add_checkpoint_argument(p)


def _tree_arguments(p: argparse.ArgumentParser) -> None:
    add_run_argument(p, "the tree of its checkpoint's codes")
    p.add_argument("--depth", type=int, default=6, help="deepest code prefix shown (default 6)")
    p.add_argument(
        "--json",
        help="where to write the tree (default RUN_DIR/tree.json; RUN_DIR/tree-best.json for --checkpoint best)",
    )
    add_source_argument(p)
    add_checkpoint_argument(p)


def _predict_arguments(p: argparse.ArgumentParser) -> None:
    add_run_argument(p, "its model and final clusters sort the images")
    p.add_argument("--images", required=True, metavar="PATH", help="an image, an image folder, a list file or shards")
    p.add_argument("--out", required=True, metavar="FILE", help="FILE.jsonl or FILE.csv")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_source_argument(p)
    add_checkpoint_argument(p)


def _report_arguments(p: argparse.ArgumentParser) -> None:
    add_run_argument(p, "RUN_DIR/report.html is written there")
    p.add_argument("--depth", type=int, default=4, help="depth of the tree picture (default 4)")
    add_source_argument(p)
    add_checkpoint_argument(p)


def _name_arguments(p: argparse.ArgumentParser) -> None:
    add_run_argument(p, "a finished run on your own images, whose novel clusters are named")
    p.add_argument("names", nargs="+", metavar="novel-K=NAME", help='e.g. novel-7="Blue Jay" (kept in RUN/names.json)')


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="a finished run on your own images, clusters named")
    p.add_argument("--out", required=True, metavar="DIR", help="the new discovery folder (new or empty)")


def _estimate_k_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="RUN_DIR", help="a run folder: its checkpoint's features of the train samples")
    p.add_argument("--features", metavar="FILE.npz", help="an .npz with F [N, D] and y [N]")
    p.add_argument("--known-classes", type=int, metavar="C", help="with --features: classes 0..C-1 are known")
    p.add_argument(
        "--rule",
        choices=("neighbours", "score"),
        default="neighbours",
        help="neighbours (default): count the unlabelled images without labelled neighbours, in classes of the known "
        "classes' mean size; score: search GCD's labelled-accuracy score over K (docs/kmeans.md compares them)",
    )
    p.add_argument("--k-max", type=int, help="with --rule score: largest K searched (default 4 x the known classes)")
    p.add_argument("--seeds", type=int, help="with --rule score: k-means runs averaged per K (default 4)")
    p.add_argument("--json", help="also write the result here")
    add_source_argument(p)


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("--seeds", required=True, help="train.seed values: a range 1-5, a list 1,3,7, or both")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a config key and its values; several --grid run every combination",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    p.add_argument("--out", required=True, help="the sweep folder (the same command again continues it)")
    p.add_argument(
        "--devices",
        help="cuda:0,cuda:1 (one run per GPU at a time) or cpu; default: one run after "
        "another in this process, on the config's train.device",
    )


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP", help="run folders and sweep folders")
    p.add_argument(
        "--out",
        default="compare.html",
        help="the HTML page (default compare.html); its PNGs go to the folder of its name",
    )
    p.add_argument("--json", help="also write the comparison here as JSON")
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="DATASET",
        help="also show the paper's published rows for this dataset (cub, aircraft, scars, pets, "
        "herbarium19, cifar10, cifar100, imagenet100), in their own table",
    )


# (name, help, arguments, handler) of each subcommand, in the order `infosieve --help` lists them
_COMMANDS = (
    ("train", "train InfoSieve (or resume a run)", _train_arguments, _train),
    ("eval", "recompute All/Old/New accuracy from a run's checkpoint", _eval_arguments, _eval),
    ("tree", "the implicit category tree of a run's learned codes", _tree_arguments, _tree),
    ("predict", "sort new images with a trained run (cluster, name, margin, code)", _predict_arguments, _predict),
    ("report", "write RUN/report.html: losses, schedules, accuracy, confusion, the tree", _report_arguments, _report),
    ("name", "name a run's novel clusters (RUN/names.json; predict, report, tree and export use the names)",
     _name_arguments, _name),
    ("export", "your images again, named clusters as labelled classes, for the next round", _export_arguments,
     _export),
    ("estimate-k", "estimate the number of categories from a run or features", _estimate_k_arguments,
     _estimate_k),
    ("make-shards", "write a dataset's GCD split as WebDataset shards", shards.add_cli_arguments, _make_shards),
    ("sweep", "run a config over seeds and a grid of --set values, and summarise them", _sweep_arguments, _sweep),
    ("compare", "runs and sweeps side by side, beside the paper's published numbers", _compare_arguments, _compare),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infosieve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_arguments, handler in _COMMANDS:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=handler)
    return parser


# the arguments that name files or folders: `~` there is the home folder even where no shell expanded it
# (`--out=~/run`, a launcher's argument list)
_PATH_ARGUMENTS = ("config", "out", "resume", "run", "images", "json", "features", "root", "paths", "data_shards")


def _expand_user(args: argparse.Namespace) -> argparse.Namespace:
    for name in _PATH_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(args, name, [os.path.expanduser(v) for v in value])
    return args


def main(argv: list[str] | None = None) -> int:
    args = _expand_user(build_parser().parse_args(argv))
    try:
        if getattr(args, "depth", 0) < 0:  # tree's and report's, checked before the run is read
            raise UsageError(f"--depth {args.depth}: the deepest code prefix shown must be 0 or more, e.g. --depth 4")
        with typed_source(getattr(args, "data_shards", None)):
            return args.func(args)
    except (config_mod.ConfigError, FileNotFoundError, FileExistsError, ValueError, DiskWriteError) as err:
        if getattr(args, "run", None) and not isinstance(err, UsageError):  # what a --run that is not there lacks
            from .analysis.run_reader import run_folder_problem

            err = run_folder_problem(args.run) or err
        print(f"error: {terminal_safe(str(err))}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder that cannot be written (read-only, full), a download that failed
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        return 1


_OS_ERROR_FIX = {
    errno.ENOSPC: "free space there, or choose another folder",
    errno.EDQUOT: "free space there, or choose another folder",
    errno.EROFS: "choose a folder you can write to",
    errno.EACCES: "choose a folder you can write to, or fix its permissions",
    errno.EPERM: "choose a folder you can write to, or fix its permissions",
}


def os_error_line(err: OSError) -> str:
    """An OSError as one line: the file, the system's words and errno, and the fix for the common ones (a
    ConnectionError of the shard download carries its own message)."""
    if err.errno is None or err.strerror is None:
        return " ".join(str(err).split())
    where = f"{err.filename}: " if err.filename is not None else ""
    fix = _OS_ERROR_FIX.get(err.errno)
    return f"{where}{err.strerror} (errno {err.errno}){'; ' + fix if fix else ''}"


if __name__ == "__main__":
    sys.exit(main())

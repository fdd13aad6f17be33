"""Opening a run folder runs nothing and fetches nothing.

A run records where its data came from (`data.shards`), and the commands that read a run back rebuild its train set
from there: `eval`, `tree`, `report --checkpoint best` (and its gallery), `estimate-k`, `predict --checkpoint best` and
`train --resume`. Shards named by a shell command (`pipe:...`) or a URL (`http(s)://...`) would then run that command
or fetch from that host, and a run folder may come from anyone. So a recorded source of that kind is used only when
this command line names it: `--data.shards VALUE` (the same value, or a local copy of the shards) stands in for the
recorded one; without it the command stops in one line naming the recorded value and that flag. A backbone that timm
would fetch from the Hugging Face Hub (`model.backbone: hf-hub:...`) is refused when a run is read: the checkpoint
holds every weight, and nothing is fetched that the person did not type.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ..config.settings import Config, from_saved
from ..data.reading.remote import is_remote

SOURCE_FLAG = "--data.shards"
HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's prefixes for a model fetched from the Hugging Face Hub
_typed: ContextVar[str | None] = ContextVar("typed_data_shards", default=None)


class RecordedSourceRefused(ValueError):
    """A run folder's own settings would run a command or fetch from a host: one line, naming the way to allow it."""


@contextmanager
def typed_source(value: str | None) -> Iterator[None]:
    """Within the block, `value` is this command line's `--data.shards` (None: not given), which `run_config` puts in
    place of a run's recorded source."""
    token = _typed.set(value)
    try:
        yield
    finally:
        _typed.reset(token)


def run_config(saved: dict, run_dir: str | Path, reads_data: bool = True) -> Config:
    """The config a run recorded (`saved`: its checkpoint's), safe to open: the command line's `--data.shards` in place
    of the recorded source where one was given, and `refuse_fetches` on the rest. `reads_data`: the caller rebuilds
    the run's train set (else only the backbone is checked)."""
    cfg = from_saved(saved)
    typed = _typed.get()
    if typed is not None:
        cfg.data.shards = typed
    refuse_fetches(cfg, run_dir, shards_typed=typed is not None or not reads_data)
    return cfg


def refuse_fetches(cfg: Config, run_dir: str | Path, shards_typed: bool) -> None:
    """Refuse a run's config that would run a command or fetch: a hub backbone, or (unless `shards_typed`: this command
    line named the source) `pipe:` or `http(s)://` shards."""
    if cfg.model.backbone.lower().startswith(HUB_PREFIXES):
        raise RecordedSourceRefused(
            f"{run_dir} records model.backbone={cfg.model.backbone!r}, which timm would fetch from the Hugging Face "
            "Hub: a run folder is read without fetching anything (its checkpoint holds every weight); train it with a "
            "timm model name and a local model.pretrained file"
        )
    if shards_typed or cfg.data.source != "shards":
        return
    specs = cfg.data.shards if isinstance(cfg.data.shards, list) else [cfg.data.shards]
    remote = [spec for spec in specs if isinstance(spec, str) and is_remote(spec)]
    if remote:
        what = "a shell command" if remote[0].startswith("pipe:") else "a download"
        raise RecordedSourceRefused(
            f"{run_dir} records data.shards={remote[0]!r}, {what} that reading the run would start: a run folder runs "
            f"and fetches nothing on its own. To use that source, name it yourself on this command line: "
            f"{SOURCE_FLAG} {shlex.quote(remote[0])} (or {SOURCE_FLAG} a local copy of the shards)"
        )

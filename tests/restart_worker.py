"""One torchrun worker of tests/test_preemption.py's restarted launches: `infosieve train ... --resume auto` as the
command line runs it, after patching one training step of one rank to stop the group (the package has no test hook).

    torchrun ... tests/restart_worker.py RUN_DIR PLAN [--set KEY=VALUE ...]

PLAN names what rank 1 does in each launch of the group (TORCHELASTIC_RESTART_COUNT picks it), comma-separated:
`sigterm@N` sends itself SIGTERM after its N-th step of that launch (every rank must stop at the same step, with a
mid-epoch checkpoint), `sigkill@N` kills itself with SIGKILL there, `-` does nothing (the launch runs to the end).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def patch(action: str) -> None:
    """Make this process do `action` ("sigterm@N" or "sigkill@N") right after its N-th training step's update."""
    from infosieve_fast import loss_monitor

    name, _, n = action.partition("@")
    sig = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[name]
    record, count = loss_monitor.LossMonitor.record, [0]

    def recording(self, parts):
        record(self, parts)
        count[0] += 1
        if count[0] == int(n):
            os.kill(os.getpid(), sig)

    loss_monitor.LossMonitor.record = recording


def main(run_dir: str, plan: str, *sets: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from infosieve_fast import cli

    action = plan.split(",")[int(os.environ["TORCHELASTIC_RESTART_COUNT"])]
    if action != "-" and os.environ["RANK"] == "1":
        patch(action)
    return cli.main(["train", "--config", "configs/demo.yaml", "--out", run_dir, "--resume", "auto", *sets])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""One torchrun worker of tests/test_preemption.py's restarted launches: `infosieve train ... --resume auto` as the
command line runs it, after patching one training step of one rank to stop the group (the package has no test hook).

    torchrun ... tests/restart_worker.py RUN_DIR PLAN [--set KEY=VALUE ...]

PLAN lists what rank 1 does, one action per launch that reaches it, comma-separated: `sigterm@N` sends itself SIGTERM
after its N-th step of that launch (every rank must stop at the same step, with a mid-epoch checkpoint), `sigkill@N`
kills itself with SIGKILL there. RUN_DIR.plan counts the actions taken (each written before it is taken), so a launch
that fails for another reason (a slow rank's connection refused under load) repeats no action and skips none; once
the plan is done the launches run to the end.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def patch(action: str, taken: Path) -> None:
    """Make this process do `action` ("sigterm@N" or "sigkill@N") right after its N-th training step's update, first
    adding a line to `taken`."""
    from infosieve_fast.training import loss_monitor

    name, _, n = action.partition("@")
    sig = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[name]
    record, count = loss_monitor.LossMonitor.record, [0]

    def recording(self, parts):
        record(self, parts)
        count[0] += 1
        if count[0] == int(n):
            with open(taken, "a") as f:
                f.write(action + "\n")
            os.kill(os.getpid(), sig)

    loss_monitor.LossMonitor.record = recording


def join_group() -> None:
    """The gloo group of this launch, its keys kept apart from earlier launches' in torchrun's store: under load a
    restarted rank could read a dead rank's address left by the previous launch (gloo: connection refused)."""
    import torch.distributed as dist

    restart, env = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False)
    prefixed = dist.PrefixStore(f"launch-{restart}", store)
    dist.init_process_group("gloo", store=prefixed, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))


def main(run_dir: str, plan: str, *sets: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from infosieve_fast import cli

    join_group()  # cli's own start of the group (distributed.init_from_env) then finds it

    taken = Path(run_dir + ".plan")
    done = len(taken.read_text().splitlines()) if taken.is_file() else 0
    actions = [a for a in plan.split(",") if a != "-"]
    if os.environ["RANK"] == "1" and done < len(actions):
        patch(actions[done], taken)
    return cli.main(["train", "--config", "configs/demo.yaml", "--out", run_dir, "--resume", "auto", *sets])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

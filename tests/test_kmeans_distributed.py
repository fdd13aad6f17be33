"""Two gloo processes on the CPU, each with its shard, give exactly the one-process clustering."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infosieve_fast.common import distributed as d
from infosieve_fast.kmeans import semi_supervised_kmeans
from tests.test_kmeans import blobs

MODES = {
    "plain": {},
    "capacity": {"balanced": True},
    "reference": {"balanced": True, "balance": "reference"},
    "frozen": {"freeze_labelled_centers": True},
}


def _data():
    return blobs(n=360, d=6, k=6, n_known=3, seed=12, spread=2.0, weights=[0.3, 0.1, 0.1, 0.2, 0.2, 0.1])


def _shard(x, rank, world):
    n = x.shape[0]
    cut = [n * r // world for r in range(world + 1)]
    cut[1] += 7  # uneven shards
    return x[cut[rank] : cut[rank + 1]]


def _worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        assert d.is_distributed() and d.get_rank() == rank and d.get_world_size() == world
        g, off = d.all_gather_cat(torch.arange(rank + 2))
        assert g.tolist() == [0, 1, 0, 1, 2] and off == [0, 2][rank]
        u, l, t, _ = _data()
        res = {}
        for name, kw in MODES.items():
            r = semi_supervised_kmeans(
                _shard(u, rank, world),
                _shard(l, rank, world),
                _shard(t, rank, world),
                6,
                n_init=3,
                seed=1,
                backend="torch",
                **kw,
            )
            res[name] = (r.labels, r.centers, r.inertia, r.history)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", list(MODES))
def test_two_processes_equal_one_process(two_process_results, mode):
    u, l, t, _ = _data()
    single = semi_supervised_kmeans(u, l, t, 6, n_init=3, seed=1, backend="torch", **MODES[mode])
    nl = [len(_shard(l, r, 2)) for r in range(2)]
    parts = [two_process_results[r][mode] for r in range(2)]
    l_lab = torch.cat([parts[r][0][: nl[r]] for r in range(2)])
    u_lab = torch.cat([parts[r][0][nl[r] :] for r in range(2)])
    assert torch.equal(torch.cat([l_lab, u_lab]), single.labels)
    for r in range(2):
        torch.testing.assert_close(parts[r][1], single.centers, rtol=1e-12, atol=1e-12)
        assert parts[r][2] == pytest.approx(single.inertia, rel=1e-12)
        assert parts[r][3] == pytest.approx(single.history, rel=1e-12)

"""A store counter updated without store.add: passes under the default schedule, and
fakepg.explore finds (and shrinks) the schedule that loses an update."""

import torch.distributed as dist

import fakepg


def counter(rank: int) -> None:
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("n", "0")
    dist.barrier()
    store.set("n", str(int(store.get("n")) + 1))  # read, then write: not atomic
    dist.barrier()
    assert int(store.get("n")) == dist.get_world_size(), "lost update"


fakepg.spawn(counter, nprocs=2)  # passes: round robin never loses the update
try:
    fakepg.explore(counter, nprocs=2, runs=100)
except fakepg.ExplorationError as err:
    print(f"{type(err).__name__}: {err}")

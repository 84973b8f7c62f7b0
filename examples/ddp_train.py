"""A plain DDP training script, written for torchrun; runs unmodified under fakerun.

    fakerun --nproc-per-node 4 examples/ddp_train.py --epochs 2     # one process, 4 ranks
    torchrun --nproc-per-node 4 examples/ddp_train.py --epochs 2    # 4 processes on gloo
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun's environment says who and where this rank is
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard
    for epoch in range(args.epochs):
        for _ in range(10):
            x = torch.randn(8, 16, generator=data)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} on rank 0 of {world}")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if rank == 0:
        print("replicas equal on all ranks:", all(torch.equal(g, weights) for g in gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Data-parallel training with graphgear, one process per rank.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--mode max-autotune|reduce-overhead] [--steps 3]

``torch.compile(DistributedDataParallel(model), backend="graphgear")`` with dynamo's DDP
optimizer (one graph per gradient bucket, so the all-reduce of a bucket overlaps the
backward of the next). Every rank trains on its slice of the same global batch; after
each SGD step the loss and every gradient are checked against the whole model trained
eagerly on the whole batch in this process. gloo on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphgear

log = logging.getLogger("ddp_train")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.relu(self.l1(x)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("max-autotune", "reduce-overhead"), default="reduce-overhead")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(format=f"[rank {os.environ.get('RANK', '?')}] %(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # the default; graphs split at bucket boundaries
    torch.manual_seed(0)
    ref = Net()
    ddp = DDP(copy.deepcopy(ref), bucket_cap_mb=1)
    step = torch.compile(ddp, backend="graphgear", options={"mode": args.mode})
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    per_rank = 4
    for i in range(args.steps):
        x, y = torch.randn(world * per_rank, 16, generator=gen), torch.randn(world * per_rank, 4, generator=gen)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.mse_loss(step(x[mine]), y[mine])
        loss.backward()  # DDP all-reduces (averages) the gradients
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, ref_loss, rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(ddp.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        log.info("step %d: loss %.6f = single-process eager; every gradient equal", i, float(total / world))
    recs = graphgear.stats().graphs
    log.info("%s: %d graphs (%d forward, %d backward: the DDP optimizer's buckets), %d captures, %d replays",
             args.mode, len(recs), sum(r.stage == "forward" for r in recs), sum(r.stage == "backward" for r in recs),
             sum(r.captures for r in recs), sum(r.replays for r in recs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tensor-parallel decoding with graphgear, one process per rank.

    torchrun --nproc-per-node 2 examples/tp_decode.py [--tp dtensor|megatron] [--steps 8]

Each rank builds the same full model (the same seed, as a checkpoint loader would), keeps
its shard (``graphgear.bench.toy_decoder_tp``), compiles it with graphgear in reduce-overhead
with batch gears [1, 2, 4] and decodes greedily, checking every step's logits against the
full model run eagerly on this rank. gloo on the CPU; on GPUs use ``--backend nccl``
(untested: no GPU was available when this was written).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import graphgear
from graphgear.bench import toy_decoder_tp
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

log = logging.getLogger("tp_decode")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", choices=("dtensor", "megatron"), default="dtensor")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, choices=(1, 2, 4), help="one of the gears")
    p.add_argument("--backend", default="gloo")
    args = p.parse_args()
    logging.basicConfig(format=f"[rank {os.environ.get('RANK', '?')}] %(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    # a finite timeout: a rank that raises (a GearError, anything) leaves its peers waiting until it
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = DecoderConfig(max_batch_size=4, max_seq_len=32)
    full = ToyDecoder(cfg).eval()
    if args.tp == "dtensor":
        model = toy_decoder_tp.dtensor(full, init_device_mesh("cpu", (world,)))
    else:
        model = toy_decoder_tp.megatron(full, rank, world)
    step = torch.compile(model.eval(), backend="graphgear", options={"mode": "reduce-overhead"})
    tokens = torch.zeros(args.batch, 1, dtype=torch.long)  # every rank: the same tokens
    worst = 0.0
    with torch.no_grad():
        for pos in range(args.steps):
            graphgear.set_dim_gears(tokens, {0: [1, 2, 4]})
            out = step(tokens, torch.tensor([pos]))
            logits = out.full_tensor() if hasattr(out, "full_tensor") else out.clone()
            want = full(tokens, torch.tensor([pos]))
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            worst = max(worst, float((logits - want).abs().max()))
            tokens = logits[:, -1:].argmax(-1)
    recs = graphgear.stats().graphs
    log.info("%s: %d steps at batch %d, logits = 1-rank eager (max diff %.1e); %d graph(s), %d capture(s), "
             "%d replays", args.tp, args.steps, args.batch, worst, len(recs), sum(r.captures for r in recs),
             sum(r.replays for r in recs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

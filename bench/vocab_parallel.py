""".venv/bin/python bench/vocab_parallel.py [--tp 4] [--vocab 32768] [--seq 2048] [--hidden 1024] [--chunk 1024]

What the output head and its loss cost one tp rank, with the head whole on every rank (as before issue 35) and split
by vocabulary rows (`clustertrain.parallel.vocab`): the peak bytes the loss and its backward allocate on top of
their inputs (the logits or their chunks, their gradients, the head's weight gradient; counted by the plan's own
`LiveBytes`), and the wall time, for the full loss and the chunked one. `--tp` gloo ranks on the CPU, one thread
each; every rank computes the loss of the same `--seq` tokens, as tp ranks do. The four losses agree (printed).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from clustertrain.distributed.spawn import free_port
from clustertrain.model.loss import VocabShard, chunked_loss_sum, full_loss_sum, sharded_loss_sum
from clustertrain.plan.fake import LiveBytes


def cases(args, shard: VocabShard):
    """name -> the loss of one way, of the hidden states, the head's weight (whole, or this rank's rows of it
    for a split head) and the labels."""
    def whole_full(h, w, y):
        return full_loss_sum(F.linear(h, w), y)

    def whole_chunked(h, w, y):
        return chunked_loss_sum(h, w, None, y, args.chunk)

    def split_full(h, w, y):
        return sharded_loss_sum(F.linear(h, w), y, shard)

    def split_chunked(h, w, y):
        return chunked_loss_sum(h, w, None, y, args.chunk, shard)

    return {"whole head, full loss": whole_full, "whole head, chunked loss": whole_chunked,
            "split head, full loss": split_full, "split head, chunked loss": split_chunked}


def rank(index: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=args.tp)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.seq, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5
    labels = torch.randint(0, args.vocab, (args.seq,), generator=g)
    per_rank = -(-args.vocab // args.tp)
    rows = slice(index * per_rank, (index + 1) * per_rank)
    shard = VocabShard(rows.start, dist.group.WORLD)
    results = []
    warm = hidden[:64].clone().requires_grad_()
    chunked_loss_sum(warm, weight[rows].clone().requires_grad_(), None, labels[:64], args.chunk, shard).backward()
    for name, loss_of in cases(args, shard).items():
        h = hidden.clone().requires_grad_()
        w = (weight[rows] if name.startswith("split") else weight).clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        with LiveBytes() as counted:
            loss = loss_of(h, w, labels)
            loss.backward()
        results.append((name, counted.peak, time.perf_counter() - start, loss.item()))
        del h, w, loss
    if index == 0:
        print(f"tp {args.tp}, vocabulary {args.vocab:,}, {args.seq:,} tokens, hidden {args.hidden}, chunks of "
              f"{args.chunk} tokens; per rank:")
        print(f"{'':28s}{'peak MiB':>10s}{'seconds':>10s}{'loss':>14s}")
        for name, peak, seconds, loss in results:
            print(f"{name:28s}{peak / 2**20:10.0f}{seconds:10.2f}{loss:14.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    mp.start_processes(rank, args=(free_port(), args), nprocs=args.tp, start_method="spawn")


if __name__ == "__main__":
    main()

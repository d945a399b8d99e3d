#!/usr/bin/env python3
"""loombench's measurement on PyTorch's gloo backend (torch.distributed).

One rank per process, started with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; cmd/loombench/compare_tcp.sh starts
the processes itself). For each op and size it times -iters calls after
-warmup untimed ones, each iteration counting as the slowest rank's time,
and writes loombench's CSV columns (impl,op,variant,nranks,bytes,iters,
time_us,min_us,algbw_GBps,busbw_GBps,note) with loombench's conventions:
float32, out of place (AllReduce in place: gloo's has no separate
output), bytes the larger of a rank's send and receive
buffers (AllGather: the gathered buffer, ReduceScatter: the buffer it
scatters), bus bandwidth the algorithm bandwidth times 2(p-1)/p for
AllReduce and (p-1)/p for AllGather, ReduceScatter and AllToAll, time the
median over iterations. An op gloo lacks (ReduceScatter in PyTorch 1.13)
gets a row with empty times and the note "unsupported: <why>".

Usage: bench.py -op allreduce,allgather,reducescatter,alltoall
                -sizes 1048576,67108864 [-iters 20] [-warmup 5] [-csv out.csv]
"""

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-op", default="allreduce")
    p.add_argument("-sizes", default="1048576,67108864")
    p.add_argument("-iters", type=int, default=20)
    p.add_argument("-warmup", type=int, default=5)
    p.add_argument("-csv", default="")
    a = p.parse_args()
    if a.iters < 1 or a.warmup < 0:
        p.error("-iters must be at least 1 and -warmup at least 0")
    a.ops = [o.strip() for o in a.op.split(",") if o.strip()]
    a.sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    for o in a.ops:
        if o not in ("allreduce", "allgather", "reducescatter", "alltoall"):
            p.error(f"-op {o}: want allreduce, allgather, reducescatter or alltoall")
    return a


def make_call(op, nbytes, p):
    """Returns (call, bus factor) for op at nbytes over p ranks."""
    count = nbytes // 4
    if op == "allreduce":
        # In place: gloo's all_reduce has no separate output, and a copy
        # before it would be charged to gloo.
        x = torch.ones(count, dtype=torch.float32)
        return (lambda: dist.all_reduce(x)), 2 * (p - 1) / p
    if op == "allgather":
        x = torch.ones(count // p, dtype=torch.float32)
        outs = [torch.empty_like(x) for _ in range(p)]
        return (lambda: dist.all_gather(outs, x)), (p - 1) / p
    if op == "reducescatter":
        ins = [torch.ones(count // p, dtype=torch.float32) for _ in range(p)]
        out = torch.empty(count // p, dtype=torch.float32)
        return (lambda: dist.reduce_scatter(out, ins)), (p - 1) / p
    x = torch.ones(count, dtype=torch.float32)
    y = torch.empty_like(x)
    return (lambda: dist.all_to_all_single(y, x)), (p - 1) / p


def main():
    a = parse_args()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=int(os.environ.get("GLOO_BENCH_TIMEOUT", "600")))
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = []
    for op in a.ops:
        for nbytes in a.sizes:
            call, factor = make_call(op, nbytes, p)
            try:
                for _ in range(a.warmup):
                    call()
            except RuntimeError as e:  # gloo lacks the op
                why = str(e).splitlines()[0].replace(",", ";")
                rows.append(["gloo", op, "auto", p, nbytes, a.iters, "", "", "", "", "unsupported: " + why])
                continue
            durs = torch.empty(a.iters, dtype=torch.float64)
            for i in range(a.iters):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                durs[i] = time.perf_counter() - t0
            dist.all_reduce(durs, op=dist.ReduceOp.MAX)
            med, lo = statistics.median(durs.tolist()), min(durs.tolist())
            algbw = nbytes / med / 1e9
            rows.append(["gloo", op, "auto", p, nbytes, a.iters, f"{med * 1e6:.3f}", f"{lo * 1e6:.3f}",
                         f"{algbw:.4f}", f"{algbw * factor:.4f}", "inplace" if op == "allreduce" else ""])
            if rank == 0:
                print(f"{op:14s} {nbytes:>10d} B  {med * 1e6:12.1f} us  busbw {algbw * factor:8.3f} GB/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["impl", "op", "variant", "nranks", "bytes", "iters", "time_us", "min_us",
                        "algbw_GBps", "busbw_GBps", "note"])
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())

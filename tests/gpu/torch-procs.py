#!/usr/bin/env python3
"""PyTorch multiprocessing in one gpu-mps pod (tests/gpu/hostile.sh, H3.torch): K worker
processes each take CUDA, fill device memory in chunks until the allocator refuses, hold it
while the others fill, and report. With gpu-mps.io/cuda-processes = N < K, N workers get the
container's memory limit split N ways and the others fail to initialise CUDA with an MPS error.

    python3 torch-procs.py K [--chunk-mib 64] [--max-mib 8192] [--hold-seconds 4]

One JSON line per worker on stdout.
"""
import argparse
import json
import os
import time

import torch
import torch.multiprocessing as mp


def worker(rank, chunk_mib, max_mib, hold, start_at):
    out = {"worker": rank, "pid": os.getpid()}
    time.sleep(max(0.0, start_at - time.time()) + 0.3 * rank)
    t0 = time.monotonic()
    try:
        torch.cuda.init()
        props = torch.cuda.get_device_properties(0)
        out["sms"] = props.multi_processor_count
        free, total = torch.cuda.mem_get_info()
        out["free_mib_at_start"], out["total_mib"] = free >> 20, total >> 20
        out["init_s"] = round(time.monotonic() - t0, 3)
        held, filled = [], 0
        while filled + chunk_mib <= max_mib:
            try:
                held.append(torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda").fill_(1))
                filled += chunk_mib
            except torch.OutOfMemoryError:
                break
        torch.cuda.synchronize()
        out.update(ok=True, filled_mib=filled)
        print(json.dumps(out), flush=True)
        time.sleep(hold)
    except Exception as e:  # the point: what a refused process sees
        out.update(ok=False, error=str(e).splitlines()[0][:300], init_s=round(time.monotonic() - t0, 3))
        print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workers", type=int)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--max-mib", type=int, default=8192)
    ap.add_argument("--hold-seconds", type=float, default=4)
    a = ap.parse_args()
    start_at = time.time() + 1
    mp.start_processes(worker, args=(a.chunk_mib, a.max_mib, a.hold_seconds, start_at), nprocs=a.workers,
                       start_method="spawn", join=True)


if __name__ == "__main__":
    main()

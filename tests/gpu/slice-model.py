"""One pod of the schedule-by-size run (tests/gpu/schedule.sh): what the pod sees of its slice,
whether its memory limit holds, then the throughput of a small real model (PyTorch, random
weights) from a shared start time. Prints one JSON line.

    python3 slice-model.py <tag> <start-at unix s> <seconds> <expected limit MiB, 0: none>
"""
import json
import sys
import time

import torch

tag, start_at, seconds, expect_mib = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
t0 = time.time()
res = {"tag": tag}
try:
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    res.update(sms=props.multi_processor_count, free_mib=free >> 20, total_mib=total >> 20, init_s=round(time.time() - t0, 3))
    if expect_mib:
        # Under the limit: what mem_get_info says is free, less a margin. Over: 1 GiB past it.
        for key, mib in (("under_ok", (free >> 20) - 256), ("over_ok", expect_mib + 1024)):
            try:
                block = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
                block.fill_(1)
                torch.cuda.synchronize()
                res[key] = True
                del block
            except torch.OutOfMemoryError:
                res[key] = False
            torch.cuda.empty_cache()
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda().to(torch.bfloat16).eval()
    x = torch.randn(32, 128, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        while time.time() < start_at:
            time.sleep(0.002)
        n, t = 0, time.time()
        while time.time() - t < seconds:
            model(x)
            torch.cuda.synchronize()
            n += 1
        elapsed = time.time() - t
    res.update(iters=n, it_s=round(n / elapsed, 2), late_s=round(t - start_at, 3), ok=True)
except Exception as e:  # noqa: BLE001 - one JSON line whatever happens
    res.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
print(json.dumps(res), flush=True)

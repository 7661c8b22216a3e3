#!/usr/bin/env python3
"""A hostile tenant's tools, run INSIDE a gpu-mps pod on the GPU machine (tests/gpu/hostile.sh).
Standard library only: the pod sees the host's /usr read-only, so the host's python3 runs it.

    hostile-client.py stall N SECONDS      open N connections to /tmp/nvidia-mps/control, read
                                           nothing, send nothing, hold them, then close
    hostile-client.py noack N SECONDS      N connections that send a CUDA client's request,
                                           take the channel the daemon passes, and never
                                           acknowledge it; held, then closed

One JSON line on stdout at the end: what was opened and answered, with timings.
The request bytes are the measured shape (tests/gpu/shape-probe.py, docs/gpu-results.md
section 7).
"""
import array
import json
import os
import socket
import struct
import sys
import threading
import time

SCM_CREDENTIALS = 2
SO_PASSCRED = 16
PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
CONTROL = os.path.join(PIPE, "control")
CRED = b"OUTBCRED\0"


def connect(timeout):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
    s.connect(CONTROL)
    return s


def stall(n, seconds):
    held, failed, t0 = [], 0, time.monotonic()
    lock = threading.Lock()

    def one():
        nonlocal failed
        try:
            s = connect(seconds + 5)
            with lock:
                held.append(s)
        except OSError:
            with lock:
                failed += 1

    # A connect blocks once the gate's backlog is full: each from its own thread.
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    out = {"mode": "stall", "asked": n, "connected": len(held), "failed": failed,
           "held_s": round(time.monotonic() - t0, 2)}
    for s in held:
        s.close()
    return out


def noack(n, seconds):
    creds = struct.pack("iII", os.getpid(), os.getuid(), os.getgid())
    anc = [(socket.SOL_SOCKET, SCM_CREDENTIALS, creds)]
    held, answers, errors = [], [], []
    for _ in range(n):
        try:
            s = connect(10)
            hello = s.recv(64)
            t = time.monotonic()
            s.sendmsg([CRED], anc)
            s.sendmsg([struct.pack("<I", 2)], anc)
            data, cmsgs, _, _ = s.recvmsg(64, socket.CMSG_SPACE(4 * 4))
            fds = []
            for level, kind, blob in cmsgs:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(blob[: len(blob) - len(blob) % 4])
                    fds.extend(a)
            answers.append({"hello": hello.hex(), "answer": data.hex(), "fds": len(fds),
                            "answer_ms": round((time.monotonic() - t) * 1000, 2)})
            held.append((s, fds))
        except OSError as e:
            errors.append(str(e))
    time.sleep(seconds)
    for s, fds in held:
        for fd in fds:
            os.close(fd)
        s.close()
    return {"mode": "noack", "asked": n, "answered": len(answers), "answers": answers[:3], "errors": errors[:3]}


def main():
    mode, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    out = stall(n, seconds) if mode == "stall" else noack(n, seconds)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

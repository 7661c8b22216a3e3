#!/usr/bin/env python3
"""A hostile tenant's relay, run INSIDE a gpu-mps pod on the GPU machine (tests/gpu/hostile.sh H10).
Standard library only (the pod sees the host's /usr read-only).

    relay.py DIR        serve DIR/control; the pod's CUDA processes run with
                        CUDA_MPS_PIPE_DIRECTORY=DIR

Each connection a CUDA process makes to DIR/control is served by a broker process of its own,
forked for it: the broker connects to the pod's gate (/tmp/nvidia-mps/control), relays the
messages both ways (descriptors too, so the daemon's channel reaches the CUDA process), and
exits when either side closes, which is right after the handshake. So the process that
connected to the gate is gone while the CUDA process holds its channel to the server: what the
gate must count is what the server holds, not the process that connected.
"""
import array
import os
import select
import signal
import socket
import sys

GATE = "/tmp/nvidia-mps/control"
MAX_FDS = 8


def recv(s):
    fds = array.array("i")
    data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds)


def send(s, data, fds):
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    s.sendmsg([data], anc)
    for fd in fds:
        os.close(fd)


def broker(client):
    gate = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    gate.connect(GATE)
    peers = {client.fileno(): (client, gate), gate.fileno(): (gate, client)}
    while True:
        ready, _, _ = select.select(list(peers), [], [], 30)
        if not ready:
            return
        for fd in ready:
            src, dst = peers[fd]
            data, fds = recv(src)
            if not data and not fds:
                return
            send(dst, data, fds)


def main():
    directory = sys.argv[1]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "control")
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # brokers are reaped at once
    print(f"relay: serving {path}", flush=True)
    while True:
        client, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            try:
                broker(client)
            finally:
                os._exit(0)
        client.close()


if __name__ == "__main__":
    main()

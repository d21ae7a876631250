#!/usr/bin/env python3
"""A KV event publisher on pyzmq (libzmq), framed as vLLM's ZmqEventPublisher:
PUB messages [topic, seq (8 bytes big-endian), payload] and a ROUTER replay
socket that takes [b"", start seq] and answers [b"", seq, payload] per buffered
batch, then [b"", -1, b""].

Usage: zmq_publisher.py FIXTURE_DIR

It binds both sockets on free ports and prints "ready PUB_PORT REPLAY_PORT".
It waits for a subscription, publishes batches 0..7 live with 3 and 4 left
out (a gap), a two-part message that is not a batch, and garbage as batch 6;
then serves replay. A line "restart" on its stdin starts its numbering again,
as a restarted engine would, and publishes batches 0 and 1; it stops when its
stdin closes.
"""

import os
import sys

import zmq


def main():
    fixtures = sys.argv[1]
    # Rank 0 or none: the batches of the rank the test listens to.
    names = ["vllm_array", "vllm_bytes_hashes", "vllm_array_extra", "vllm_old_array"]
    payloads = [open(os.path.join(fixtures, f"{n}.msgpack"), "rb").read() for n in names]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that also reports subscriptions
    pub.bind("tcp://127.0.0.1:*")
    replay = ctx.socket(zmq.ROUTER)
    replay.bind("tcp://127.0.0.1:*")
    port = lambda s: s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    print("ready", port(pub), port(replay), flush=True)
    pub.recv()  # the first subscription
    topic = b"kv"
    buffer = []
    for seq in range(8):
        payload = b"\xc1 not msgpack" if seq == 6 else payloads[seq % len(payloads)]
        buffer.append((seq, payload))
        if seq == 2:
            pub.send_multipart([topic, b"junk"])
        if seq in (3, 4):
            continue
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if sys.stdin.fileno() in ready or sys.stdin in ready:
            line = sys.stdin.readline()
            if not line:
                break
            if line.strip() == "restart":
                buffer = [(seq, payloads[seq]) for seq in range(2)]
                for seq, payload in buffer:
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        if replay in ready:
            frame = replay.recv_multipart()
            if len(frame) != 3:
                continue
            client, _, start = frame
            start = int.from_bytes(start, "big")
            for seq, payload in buffer:
                if seq >= start:
                    replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            replay.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])


if __name__ == "__main__":
    main()

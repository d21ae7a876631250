#!/usr/bin/env python3
"""A KV event publisher on pyzmq (libzmq), framed as vLLM's ZmqEventPublisher:
PUB messages [topic, seq (8 bytes big-endian), payload] and a ROUTER replay
socket that takes [b"", start seq] and answers [b"", seq, payload] per buffered
batch, then [b"", -1, b""].

Usage:
  zmq_publisher.py FIXTURE_DIR   the ZMQ source's test script (below)
  zmq_publisher.py --stdin       the node-level test's publisher (below)

Either way it binds both sockets on free ports of 127.0.0.1 and prints
"ready PUB_PORT REPLAY_PORT", and stops when its stdin closes.

FIXTURE_DIR: it waits for a subscription, publishes batches 0..7 on topic
"kv" with 3 and 4 left out (a gap), a two-part message that is not a batch,
and garbage as batch 6; then serves replay. A line "restart" on its stdin
starts its numbering again, as a restarted engine would, and publishes
batches 0 and 1.

--stdin: it prints "subscribed" once a subscriber is on. Each line on its
stdin is one batch payload in hex (the test encodes it): it is published on
topic "" (vLLM's default) under the next sequence number, and "sent SEQ"
printed.
"""

import os
import sys

import zmq


def sockets():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that also reports subscriptions
    pub.bind("tcp://127.0.0.1:*")
    replay = ctx.socket(zmq.ROUTER)
    replay.bind("tcp://127.0.0.1:*")
    port = lambda s: s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    print("ready", port(pub), port(replay), flush=True)
    return pub, replay


def serve_replay(replay, buffer):
    """Answers one replay request from `buffer` ([(seq, payload)])."""
    frame = replay.recv_multipart()
    if len(frame) != 3:
        return
    client, _, start = frame
    start = int.from_bytes(start, "big")
    for seq, payload in buffer:
        if seq >= start:
            replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
    replay.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])


def stdin_ready(ready):
    return sys.stdin.fileno() in ready or sys.stdin in ready


def fixtures(fixture_dir):
    # Rank 0 or none: the batches of the rank the test listens to.
    names = ["vllm_array", "vllm_bytes_hashes", "vllm_array_extra", "vllm_old_array"]
    payloads = [open(os.path.join(fixture_dir, f"{n}.msgpack"), "rb").read() for n in names]
    pub, replay = sockets()
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
        if stdin_ready(ready):
            line = sys.stdin.readline()
            if not line:
                break
            if line.strip() == "restart":
                buffer = [(seq, payloads[seq]) for seq in range(2)]
                for seq, payload in buffer:
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        if replay in ready:
            serve_replay(replay, buffer)


def from_stdin():
    pub, replay = sockets()
    buffer = []
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(replay, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if pub in ready and pub.recv()[:1] == b"\x01":
            print("subscribed", flush=True)
        if stdin_ready(ready):
            line = sys.stdin.readline()
            if not line:
                break
            payload = bytes.fromhex(line.strip())
            seq = len(buffer)
            buffer.append((seq, payload))
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            print("sent", seq, flush=True)
        if replay in ready:
            serve_replay(replay, buffer)


if __name__ == "__main__":
    if sys.argv[1:] == ["--stdin"]:
        from_stdin()
    else:
        fixtures(sys.argv[1])

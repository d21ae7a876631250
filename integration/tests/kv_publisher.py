#!/usr/bin/env python3
"""A KV event publisher on pyzmq (libzmq), framed as vLLM's
ZmqEventPublisher: PUB messages [topic, seq (8 bytes big-endian), payload],
and a ROUTER replay socket that takes [b"", start seq] and answers
[b"", seq, payload] per buffered batch, then [b"", -1, b""].

Usage: kv_publisher.py

It binds both sockets on free ports of 127.0.0.1 and prints
"ready PUB_PORT REPLAY_PORT", then "subscribed" once a subscriber is on.
Each line on its stdin is one batch payload in hex (the test encodes it):
it is published under the next sequence number, and "sent SEQ" printed.
It stops when its stdin closes.
"""

import sys

import zmq


def main():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that also reports subscriptions
    pub.bind("tcp://127.0.0.1:*")
    replay = ctx.socket(zmq.ROUTER)
    replay.bind("tcp://127.0.0.1:*")
    port = lambda s: s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    print("ready", port(pub), port(replay), flush=True)
    buffer = []
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(replay, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if pub in ready:
            if pub.recv()[:1] == b"\x01":
                print("subscribed", flush=True)
        if sys.stdin.fileno() in ready or sys.stdin in ready:
            line = sys.stdin.readline()
            if not line:
                break
            payload = bytes.fromhex(line.strip())
            seq = len(buffer)
            buffer.append((seq, payload))
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            print("sent", seq, flush=True)
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

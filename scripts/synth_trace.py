#!/usr/bin/env python3
"""Writes a synthetic multi-turn trace in Mooncake's JSONL format (timestamp
ms, input_length, output_length, hash_ids of 512-token blocks), a load shape
unlike the Mooncake conversation trace, so that routing is not tuned to one
workload:

- conversations start as a Poisson process and run 2-8 turns, each turn
  after an exponential think time, so load comes in bursts;
- every conversation opens with one of a few shared system prompts, drawn
  with Zipf popularity (most requests share a long first part);
- each turn resends the whole history plus a new user message.

Deterministic for a given --seed. Usage:
  scripts/synth_trace.py --conversations 300 --seed 1 > /tmp/synth.jsonl
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--duration-s", type=float, default=300.0, help="span of conversation starts")
    ap.add_argument("--system-prompts", type=int, default=6)
    ap.add_argument("--think-s", type=float, default=15.0, help="mean time between turns")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    next_id = [1]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    systems = [fresh(rng.randint(2, 12)) for _ in range(a.system_prompts)]
    weights = [1.0 / (k + 1) for k in range(a.system_prompts)]
    rows = []
    t = 0.0
    for _ in range(a.conversations):
        t += rng.expovariate(a.conversations / a.duration_s)
        history = list(rng.choices(systems, weights)[0])
        at = t
        for _turn in range(rng.randint(2, 8)):
            history += fresh(rng.randint(1, 4))  # the user's new message
            tail = rng.randint(1, 511)
            out = rng.randint(32, 400)
            rows.append({"timestamp": int(at * 1000), "input_length": (len(history) - 1) * 512 + tail,
                         "output_length": out, "hash_ids": list(history)})
            history += fresh(max(1, out // 512 + 1))  # the assistant's answer joins the history
            at += rng.expovariate(1.0 / a.think_s)
    rows.sort(key=lambda r: r["timestamp"])
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

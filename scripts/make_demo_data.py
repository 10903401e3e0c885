#!/usr/bin/env python3
"""Writes data/demo/tokenized.jsonl: the built-in demo dataset (deterministic, no deps).

Each row is an arithmetic progression modulo the tiny model's vocabulary, preceded by a
two-token "prompt" whose labels are masked. A model that learns the rule predicts every
token after the third, so the loss visibly falls within a few dozen steps.
"""
import json
import random

VOCAB = 256
ROWS = 256

rng = random.Random(7)
with open("data/demo/tokenized.jsonl", "w") as f:
    for _ in range(ROWS):
        n = rng.randint(24, 48)
        start, stride = rng.randrange(VOCAB), rng.randint(1, 7)
        ids = [(start + i * stride) % VOCAB for i in range(n)]
        labels = [-100, -100] + ids[2:]
        f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")

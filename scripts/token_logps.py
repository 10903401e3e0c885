#!/usr/bin/env python3
"""Each label token's log-probability and entropy under an HF model, as transformers
computes them (float32 on CPU): the reference `mt-launch serve`'s `forward` is tested
against (launcher/tests/serve.rs).

Usage: token_logps.py REQUEST.json, where the file holds {"model": DIR, "rows":
[{"input_ids": [...], "labels": [...]}]} (labels unshifted, -100 where none is taken;
absent: every token). Prints {"logprobs": [[...]], "entropy": [[...]]}: per row, one value
per label token after the shift, in order.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    with open(sys.argv[1]) as f:
        req = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32)
    model.eval()
    logprobs, entropy = [], []
    with torch.no_grad():
        for row in req["rows"]:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row.get("labels", row["input_ids"]))
            logits = model(ids).logits[0, :-1].float()
            targets = labels[1:]
            keep = targets != -100
            lp = logits.log_softmax(-1)
            taken = lp[keep].gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)
            ent = -(lp.exp() * lp).sum(-1)[keep]
            logprobs.append(taken.tolist())
            entropy.append(ent.tolist())
    json.dump({"logprobs": logprobs, "entropy": entropy}, sys.stdout)


if __name__ == "__main__":
    main()

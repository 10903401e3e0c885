"""Checks that model directories exported by mt-launch load in transformers and compute the
same logits as mt-launch does.

    check_export.py --case MODEL_DIR DATA_JSONL OUR_LOGITS [--case ...] [--tol 1e-4]

For each case, OUR_LOGITS is what `mt-launch --dump-logits` wrote for a run with
`model.path: MODEL_DIR`, one worker, unshuffled DATA_JSONL in float32: the logits of the
first micro-batch of step 1 (tensor `logits`, rows x padded length x vocab, rows = the
first rows of the file). The model is loaded in float32 with the class its config.json names
(a multimodal wrapper, whose config has a `vision_config`, with AutoModelForImageTextToText;
any other with AutoModelForCausalLM) and run on the same rows (text only), right-padded with
an attention mask; ||ours - torch|| / ||torch|| over every real (non-padding) position must
be <= tol. Prints one JSON line per case; exits 1 if any case fails.
"""

import argparse
import json
import sys

import safetensors.torch
import torch
import transformers


def rows(path, n):
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r["input_ids"] for r in recs[:n]]


def check(model_dir, data, logits_path, tol):
    ours = safetensors.torch.load_file(logits_path)["logits"]
    batch = rows(data, ours.shape[0])
    t = max(len(r) for r in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with open(f"{model_dir}/config.json") as f:
        wrapped = "vision_config" in json.load(f)
    auto = transformers.AutoModelForImageTextToText if wrapped else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits.float()
    if ours.shape[0] != ref.shape[0] or ours.shape[2] != ref.shape[2]:
        raise SystemExit(f"{logits_path}: shape {tuple(ours.shape)} vs transformers {tuple(ref.shape)}")
    diff = norm = 0.0
    for i, r in enumerate(batch):
        n = len(r)
        diff += (ours[i, :n] - ref[i, :n]).double().pow(2).sum().item()
        norm += ref[i, :n].double().pow(2).sum().item()
    return (diff / norm) ** 0.5, type(model).__name__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", nargs=3, action="append", required=True,
                    metavar=("MODEL_DIR", "DATA_JSONL", "OUR_LOGITS"))
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    failed = False
    for model_dir, data, logits in args.case:
        err, cls = check(model_dir, data, logits, args.tol)
        ok = err <= args.tol
        failed |= not ok
        print(json.dumps({"model": model_dir, "class": cls, "rel_err": err, "ok": ok}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

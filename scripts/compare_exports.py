"""Loads exported model directories with transformers and compares their weights.

Usage: compare_exports.py GOT=EXPECTED [GOT=EXPECTED ...]

Each GOT directory is loaded with AutoModelForCausalLM (float32, as transformers loads a
user's export) and its state dict compared bit for bit with EXPECTED's, loaded the same
way. Prints one line per pair; exits 1 at the first pair that fails to load or differs.
launcher/tests/atomic_export.rs runs it on the output directory left by a launcher killed
at each instant of an export.
"""

import sys

import torch
from transformers import AutoModelForCausalLM


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


def main():
    for pair in sys.argv[1:]:
        got_dir, want_dir = pair.split("=", 1)
        try:
            got, want = load(got_dir), load(want_dir)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            print(f"{got_dir}: does not load: {e}", file=sys.stderr)
            sys.exit(1)
        if got.keys() != want.keys():
            print(f"{got_dir}: tensors {sorted(got.keys() ^ want.keys())} differ", file=sys.stderr)
            sys.exit(1)
        for name, t in want.items():
            if not torch.equal(got[name], t):
                print(f"{got_dir}: tensor {name} differs from {want_dir}", file=sys.stderr)
                sys.exit(1)
        print(f"{got_dir}: {len(want)} tensors equal to {want_dir}")


if __name__ == "__main__":
    main()

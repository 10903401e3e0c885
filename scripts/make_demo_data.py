#!/usr/bin/env python3
"""Writes the built-in demo: data/demo/alpaca_demo.json (alpaca-format tasks written for this
project, deterministic) and the tiny demo model's tokenizer (configs/tiny/tokenizer.json, a
byte-level BPE trained on that data, and tokenizer_config.json with a ChatML template); and
data/demo/tokenized.jsonl (the `tokenized_demo` set: arithmetic progressions modulo 256 after a
two-token prompt whose labels are masked); and data/demo/pt_demo.txt (plain-text documents for
continued pretraining).

Run from the repository root with the project venv: .venv/bin/python scripts/make_demo_data.py
The outputs are committed; this script documents and reproduces them.
"""
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 512
WORDS = """apple river stone cloud garden pencil window orange silver forest candle rocket
marble violin tiger harbor bridge lemon castle planet meadow copper falcon island lantern
mirror needle ocean pepper quartz saddle thunder velvet walnut yellow zebra anchor basket
cactus dragon engine feather glacier hammer igloo jacket kettle ladder magnet""".split()

rng = random.Random(20261122)


def task():
    kind = rng.randrange(8)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    w = rng.choice(WORDS)
    if kind == 0:
        return {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} + {b} = {a + b}."}
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return {"instruction": f"Subtract {b} from {a}.", "input": "", "output": f"{a} - {b} = {a - b}."}
    if kind == 2:
        return {"instruction": "Reverse the letters of the word.", "input": w, "output": w[::-1]}
    if kind == 3:
        return {"instruction": f"Write the word {w} in capital letters.", "input": "", "output": w.upper()}
    if kind == 4:
        s = rng.randint(1, 9)
        seq = [a + i * s for i in range(4)]
        return {
            "instruction": "What number comes next?",
            "input": ", ".join(map(str, seq[:3])),
            "output": f"The next number is {seq[3]}.",
        }
    if kind == 5:
        parity = "even" if a % 2 == 0 else "odd"
        return {"instruction": f"Is {a} even or odd?", "input": "", "output": f"{a} is {parity}."}
    if kind == 6:
        return {"instruction": f"How many letters are in the word {w}?", "input": "", "output": f"{w} has {len(w)} letters."}
    nums = rng.sample(range(1, 60), 4)
    return {
        "instruction": "Sort these numbers from smallest to largest.",
        "input": ", ".join(map(str, nums)),
        "output": ", ".join(map(str, sorted(nums))),
    }


rows = [task() for _ in range(240)]
for r in rows[::6]:
    r["system"] = "Answer in one short sentence."
with open("data/demo/alpaca_demo.json", "w") as f:
    f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")

TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
texts = []
for r in rows:
    texts += [r["instruction"], r["input"], r["output"], r.get("system", ""), "You are a helpful assistant."]
texts += ["system", "user", "assistant", "\n"]
tok.train_from_iterator(
    texts,
    trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ),
)
tok.save("configs/tiny/tokenizer.json")
with open("configs/tiny/tokenizer_config.json", "w") as f:
    json.dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 512,
            "chat_template": TEMPLATE,
        },
        f,
        indent=2,
    )
    f.write("\n")
print(f"{len(rows)} examples, vocabulary {tok.get_vocab_size()}")

rng = random.Random(7)
with open("data/demo/tokenized.jsonl", "w") as f:
    for _ in range(256):
        n = rng.randint(24, 48)
        start, stride = rng.randrange(256), rng.randint(1, 7)
        ids = [(start + i * stride) % 256 for i in range(n)]
        f.write(json.dumps({"input_ids": ids, "labels": [-100, -100] + ids[2:]}) + "\n")

# data/demo/pt_demo.txt (the `pt_demo` set): plain-text documents, one per line, for
# continued pretraining (training.stage: pt, configs/tiny_pt.yaml).
rng = random.Random(25)
lines = []
for k in range(48):
    s = []
    for _ in range(rng.randint(1, 4)):
        a, b, w, v = rng.randint(2, 99), rng.randint(2, 99), rng.choice(WORDS), rng.choice(WORDS)
        s.append(rng.choice([
            f"The {w} is next to the {v}.",
            f"{a} plus {b} makes {a + b}.",
            f"A {w} has {len(w)} letters, and {w[::-1]} is {w} backwards.",
            f"Count from {a}: {a}, {a + 1}, {a + 2}, {a + 3}.",
            f"Le {w} est près du café.",
        ]))
    lines.append(" ".join(s))
with open("data/demo/pt_demo.txt", "w") as f:
    f.write("\n".join(lines) + "\n")

# data/demo/dpo_demo.json (the `dpo_demo` set, `ranking: true`): preference pairs in
# LlamaFactory's alpaca ranking form for training.stage: dpo (configs/tiny_dpo.yaml): the demo
# tasks with the right answer `chosen` and a plausible wrong one `rejected`.
rng = random.Random(26)


def pair():
    kind = rng.randrange(6)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    w = rng.choice(WORDS)
    off = rng.choice([-2, -1, 1, 2, 10])
    if kind == 0:
        return {"instruction": f"Add {a} and {b}.", "input": "",
                "chosen": f"{a} + {b} = {a + b}.", "rejected": f"{a} + {b} = {a + b + off}."}
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return {"instruction": f"Subtract {b} from {a}.", "input": "",
                "chosen": f"{a} - {b} = {a - b}.", "rejected": f"{a} - {b} = {a + b}."}
    if kind == 2:
        return {"instruction": "Reverse the letters of the word.", "input": w,
                "chosen": w[::-1], "rejected": w}
    if kind == 3:
        parity, other = ("even", "odd") if a % 2 == 0 else ("odd", "even")
        return {"instruction": f"Is {a} even or odd?", "input": "",
                "chosen": f"{a} is {parity}.", "rejected": f"{a} is {other}."}
    if kind == 4:
        return {"instruction": f"How many letters are in the word {w}?", "input": "",
                "chosen": f"{w} has {len(w)} letters.", "rejected": f"{w} has {len(w) + abs(off)} letters."}
    nums = rng.sample(range(1, 60), 4)
    return {"instruction": "Sort these numbers from smallest to largest.", "input": ", ".join(map(str, nums)),
            "chosen": ", ".join(map(str, sorted(nums))), "rejected": ", ".join(map(str, sorted(nums, reverse=True)))}


pairs = [pair() for _ in range(48)]
for p in pairs[::8]:
    p["system"] = "Answer in one short sentence."
with open("data/demo/dpo_demo.json", "w") as f:
    f.write("[\n" + ",\n".join("  " + json.dumps(p) for p in pairs) + "\n]\n")

# data/demo/grpo_demo.jsonl (configs/tiny_grpo.yaml, training.stage: grpo): rollouts as a
# generator would write them, in text: each "Add a and b." prompt with a group of four
# completions, scored 1 when it states the sum and 0 otherwise (examples/grpo_loop.py
# makes its own, as token ids, from the model it trains).
rng = random.Random(27)
with open("data/demo/grpo_demo.jsonl", "w") as f:
    for g in range(16):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        for off in rng.sample([0, 0, -1, 1, 2, 10, -10], 4):
            f.write(json.dumps({"prompt": f"Add {a} and {b}.", "completion": f"{a} + {b} = {a + b + off}.",
                                "reward": float(off == 0), "group": g}) + "\n")

#!/usr/bin/env python3
"""Data fixtures: the token rows transformers makes of the demo datasets, for
launcher/tests/data.rs to compare with ours exactly.

For each dataset the expected row of every record is computed with the tiny demo model's
tokenizer loaded by transformers (configs/tiny: tokenizer.json + the ChatML template in
tokenizer_config.json): the conversation is rendered with `apply_chat_template` (jinja2),
tokenized without added special tokens, and a token is labelled when it starts inside an
assistant answer, i.e. between the render of the turns before it with the generation prompt
and the render of the turns up to it.

Usage: .venv/bin/python scripts/make_data_fixtures.py --out target/data-fixtures
"""
import argparse
import json
import os
import random
import shutil

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_PROMPT = "Be exact."

# A second template, written for this test, with the constructs HF templates use: bos_token,
# `tools is not none`, raise_exception, namespace, slicing, filters, Python string methods,
# loop variables, whitespace control, and an eos after every answer.
TEMPLATE2 = """{{- bos_token }}
{%- if tools is not none %}{{ raise_exception('tools are not supported') }}{% endif %}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if ns.system %}
{{ '<|im_start|>system\n' + ns.system + '<|im_end|>' }}
{% endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('roles must alternate user/assistant') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['content'].startswith('  ') %}
        {{- message['content'].lstrip() }}
    {%- else %}
        {{- message['content'].rstrip() }}
    {%- endif %}
    {{- '<|im_end|>' }}
    {%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
out = os.path.abspath(ap.parse_args().out)
os.makedirs(out, exist_ok=True)
tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))

model2 = os.path.join(out, "model-template2")
os.makedirs(model2, exist_ok=True)
shutil.copy(os.path.join(ROOT, "configs/tiny/tokenizer.json"), model2)
with open(os.path.join(model2, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
               "eos_token": "<|im_end|>", "chat_template": TEMPLATE2}, f, indent=2)
tok2 = AutoTokenizer.from_pretrained(model2)

with open(os.path.join(ROOT, "data/demo/alpaca_demo.json")) as f:
    alpaca = json.load(f)

# Multi-turn conversations built from the demo tasks, with spaces the template strips and
# non-ASCII text, in sharegpt's from/value form and in OpenAI's role/content form.
rng = random.Random(5)
convs = []
for k in range(40):
    turns = rng.sample(alpaca, rng.randint(1, 3))
    msgs = []
    if k % 4 == 0:
        msgs.append({"role": "system", "content": "Réponds brièvement ✓"})
    for t in turns:
        user = "\n".join(s for s in (t["instruction"], t["input"]) if s)
        msgs.append({"role": "user", "content": ("  " if k % 3 == 0 else "") + user})
        msgs.append({"role": "assistant", "content": t["output"] + (" \n" if k % 5 == 0 else "")})
    convs.append(msgs)
FROM = {"system": "system", "user": "human", "assistant": "gpt"}
with open(os.path.join(out, "sharegpt.jsonl"), "w") as f:
    for msgs in convs:
        rec = {"conversations": [{"from": FROM[m["role"]], "value": m["content"]} for m in msgs]}
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
with open(os.path.join(out, "openai.json"), "w") as f:
    json.dump([{"messages": msgs} for msgs in convs], f, ensure_ascii=False, indent=1)

registry = {
    "alpaca_demo": {"file_name": os.path.join(ROOT, "data/demo/alpaca_demo.json")},
    "sharegpt_demo": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt"},
    "openai_demo": {
        "file_name": "openai.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant", "system_tag": "system"},
    },
}
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump(registry, f, indent=2)


def row(msgs, tok=tok):
    full = tok.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
        turn = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
        assert turn.startswith(prompt) and full.startswith(turn)
        spans.append((len(prompt), len(turn)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        t if any(a <= s < b for a, b in spans) else -100
        for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    return {"input_ids": enc["input_ids"], "labels": labels, "text": full}


def alpaca_msgs(r):
    system = r.get("system") or SYSTEM_PROMPT
    user = "\n".join(s for s in (r["instruction"], r["input"]) if s)
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": r["output"]}]


cases = {
    "alpaca_demo": [alpaca_msgs(r) for r in alpaca],
    "sharegpt_demo": convs,
    "openai_demo": convs,
}
for name, msgs in cases.items():
    with open(os.path.join(out, f"expected_{name}.jsonl"), "w") as f:
        for m in msgs:
            f.write(json.dumps(row(m), ensure_ascii=False) + "\n")
with open(os.path.join(out, "expected_sharegpt_demo_template2.jsonl"), "w") as f:
    for m in convs:
        f.write(json.dumps(row(m, tok2), ensure_ascii=False) + "\n")
print(f"data fixtures: {', '.join(f'{k} ({len(v)} rows)' for k, v in cases.items())} in {out}")

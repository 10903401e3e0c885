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

# Hub datasets, as `hf download --repo-type dataset mt-test/alpaca-mini` would leave them in
# the cache: the alpaca demo split in two train shards and a test shard written by pyarrow
# (snapshot files are links into blobs/, as huggingface_hub makes them), and a `chat` subset
# of the sharegpt conversations (a list of structs per row). Also a Parquet file and a
# `save_to_disk` directory for dataset.path.
import datasets  # noqa: E402

datasets.disable_progress_bars()
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
repo = os.path.join(out, "hub", "datasets--mt-test--alpaca-mini")
shutil.rmtree(repo, ignore_errors=True)
snapshot = os.path.join(repo, "snapshots", COMMIT)
os.makedirs(os.path.join(repo, "refs"))
with open(os.path.join(repo, "refs", "main"), "w") as f:
    f.write(COMMIT)


def table(records):
    """Every key of any record a column (pyarrow infers the columns from the first record
    alone); absent values are nulls."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records])


def put_parquet(rel, records):
    blob = os.path.join(repo, "blobs", rel.replace("/", "_"))
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    pq.write_table(table(records), blob)
    dst = os.path.join(snapshot, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)


put_parquet("data/train-00000-of-00002.parquet", alpaca[:120])
put_parquet("data/train-00001-of-00002.parquet", alpaca[120:200])
put_parquet("data/test-00000-of-00001.parquet", alpaca[200:])
sharegpt_records = [json.loads(line) for line in open(os.path.join(out, "sharegpt.jsonl"))]
put_parquet("chat/train-00000-of-00001.parquet", sharegpt_records)
with open(os.path.join(snapshot, "README.md"), "w") as f:
    f.write("# alpaca-mini\n")
registry.update({
    "alpaca_hub": {"hf_hub_url": "mt-test/alpaca-mini"},
    "alpaca_hub_test": {"hf_hub_url": "mt-test/alpaca-mini", "split": "test"},
    "sharegpt_hub": {"hf_hub_url": "mt-test/alpaca-mini", "subset": "chat", "formatting": "sharegpt"},
    "missing_hub": {"hf_hub_url": "mt-test/not-downloaded"},
})
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump(registry, f, indent=2)
pq.write_table(table(alpaca), os.path.join(out, "alpaca.parquet"))
shutil.rmtree(os.path.join(out, "saved_alpaca"), ignore_errors=True)
datasets.Dataset.from_list(alpaca).save_to_disk(os.path.join(out, "saved_alpaca"))

# The tiny model with weights (torch's init, float32), and the summed token loss and label
# count of every alpaca row under them, one row at a time: the eval loss of any subset of
# rows follows (launcher/tests/eval.rs).
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

torch.manual_seed(0)
model_dir = os.path.join(out, "model-tiny")
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.join(ROOT, "configs/tiny"))).float()
model.save_pretrained(model_dir)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(ROOT, "configs/tiny", name), model_dir)
row_losses = []
with torch.no_grad():
    for m in cases["alpaca_demo"]:
        r = row(m)
        logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1].float()
        targets = torch.tensor(r["labels"][1:])
        loss_sum = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        row_losses.append({"loss_sum": loss_sum.item(), "tokens": int((targets != -100).sum())})
with open(os.path.join(out, "row_losses_alpaca_demo.json"), "w") as f:
    json.dump(row_losses, f)
print(f"data fixtures: hub cache {os.path.join(out, 'hub')}, tiny model and {len(row_losses)} row losses")

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

# Continued pretraining (training.stage: pt): the documents of data/demo/pt_demo.txt as a
# .txt file, JSONL (`text` column) and Parquet (dataset.path), and a hub subset, tokenized
# by LlamaFactory's pretraining rule with the tiny tokenizer (no BOS; eos `<|im_end|>`) and
# with a variant that adds a BOS and has Llama 3's `<|end_of_text|>` (the eos LlamaFactory
# uses for its llama3 template): each document + eos, then either truncated per document
# (`bos + text + eos`) or concatenated and cut into blocks, the rest dropped, the first
# token of each block the BOS.
from tokenizers import Tokenizer, processors  # noqa: E402

PT_LEN = 64
with open(os.path.join(ROOT, "data/demo/pt_demo.txt")) as f:
    docs = [line.rstrip("\n") for line in f if line.strip()]
shutil.copy(os.path.join(ROOT, "data/demo/pt_demo.txt"), os.path.join(out, "pt_demo.txt"))
with open(os.path.join(out, "pt_demo.jsonl"), "w") as f:
    for d in docs:
        f.write(json.dumps({"id": len(d), "text": d}, ensure_ascii=False) + "\n")
pq.write_table(table([{"text": d} for d in docs]), os.path.join(out, "pt_demo.parquet"))
put_parquet("text/train-00000-of-00001.parquet", [{"text": d} for d in docs])
registry.update({
    "pt_txt": {"file_name": "pt_demo.txt", "columns": {"prompt": "text"}},
    "pt_jsonl": {"file_name": "pt_demo.jsonl", "columns": {"prompt": "text"}},
    "pt_hub": {"hf_hub_url": "mt-test/alpaca-mini", "subset": "text", "columns": {"prompt": "text"}},
    "ranking_demo": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt", "ranking": True,
                     "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
})

model_bos = os.path.join(out, "model-bos")
os.makedirs(model_bos, exist_ok=True)
bos_tok = Tokenizer.from_file(os.path.join(ROOT, "configs/tiny/tokenizer.json"))
bos_tok.add_special_tokens(["<|end_of_text|>"])
bos_tok.post_processor = processors.TemplateProcessing(
    single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
    special_tokens=[("<|endoftext|>", bos_tok.token_to_id("<|endoftext|>"))])
bos_tok.save(os.path.join(model_bos, "tokenizer.json"))
with open(os.path.join(model_bos, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
               "eos_token": "<|im_end|>"}, f, indent=2)


def pt_rows(tok, docs, packing, block=PT_LEN):
    """LlamaFactory's PretrainDatasetProcessor on `docs`; the BOS is the token the tokenizer
    adds in front when asked for special tokens."""
    eos = "<|end_of_text|>" if "<|end_of_text|>" in tok.get_vocab() else tok.eos_token
    plain = tok("a", add_special_tokens=False)["input_ids"]
    added = tok("a")["input_ids"]
    bos = added[0] if len(added) > len(plain) and added[1:1 + len(plain)] == plain else None
    texts = [d + eos for d in docs]
    if not packing:
        if bos is not None:
            texts = [tok.convert_ids_to_tokens(bos) + t for t in texts]
        ids = tok(texts, add_special_tokens=False, truncation=True, max_length=block)["input_ids"]
        return [{"input_ids": r, "labels": r} for r in ids]
    ids = [t for r in tok(texts, add_special_tokens=False)["input_ids"] for t in r]
    total = len(ids) // block * block
    rows = [ids[i:i + block] for i in range(0, total, block)]
    if bos is not None:
        for r in rows:
            r[0] = bos
    return [{"input_ids": r, "labels": r} for r in rows]


tok_bos = AutoTokenizer.from_pretrained(model_bos)
assert tok_bos("a")["input_ids"][0] == tok_bos.convert_tokens_to_ids("<|endoftext|>")
for model_name, t in (("tiny", tok), ("bos", tok_bos)):
    for packing in (False, True):
        with open(os.path.join(out, f"expected_pt_{model_name}_{'packed' if packing else 'docs'}.jsonl"), "w") as f:
            for r in pt_rows(t, docs, packing):
                f.write(json.dumps(r) + "\n")

# Tool calling: glaive_toolcall_en_demo-style sharegpt records (`function_call` turns holding
# {"name", "arguments"} or a list of them, `observation` turns, a `tools` column holding a
# JSON list of bare function definitions) rendered by the Qwen2.5, Llama 3.1 and Mistral v0.3
# templates (scripts/fixture_templates.py) as `apply_chat_template(messages, tools=...)`
# renders them; call ids `call00000`, `call00001`, ... in the conversation; labels on the
# assistant turns, tool calls included, never on the tool answers.
import collections  # noqa: E402

from fixture_templates import LLAMA31, MISTRAL_V03, QWEN25  # noqa: E402

TOOLS = [
    {"name": "calculate_tip", "description": "Calculate the tip for a bill",
     "parameters": {"type": "object", "properties": {
         "bill_amount": {"type": "number", "description": "The bill, in dollars"},
         "tip_percentage": {"type": "number", "description": "The tip, in percent"}},
         "required": ["bill_amount", "tip_percentage"]}},
    {"name": "get_weather", "description": "Météo actuelle d'une ville",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "units": {"type": "string", "enum": ["metric", "imperial"]}},
         "required": ["city"]}},
    {"name": "search_recipes", "description": "Search recipes by ingredients",
     "parameters": {"type": "object", "properties": {
         "ingredients": {"type": "array", "items": {"type": "string"}}}, "required": ["ingredients"]}},
]
rng = random.Random(11)


def call(name):
    if name == "calculate_tip":
        return {"name": name, "arguments": {"bill_amount": rng.choice([42.5, 100, 17.25]),
                                            "tip_percentage": rng.choice([15, 20, 12.5])}}
    if name == "get_weather":
        return {"name": name, "arguments": {"city": rng.choice(["Paris", "Zürich", "Tokyo"]),
                                            "units": "metric"}}
    return {"name": name, "arguments": {"ingredients": rng.sample(["egg", "rice", "leek", "feta"], 2)}}


def tool_record(k, multi, system):
    names = [t["name"] for t in TOOLS]
    conv = [{"from": "human", "value": f"Question {k}: can you help me with {rng.choice(names)}?"}]
    for turn in range(rng.randint(1, 2)):
        if turn > 0:
            conv.append({"from": "human", "value": f"Thanks! One more thing ({k}.{turn})."})
        if rng.random() < 0.2:
            conv.append({"from": "gpt", "value": "I can only do that with the tools I have."})
            continue
        calls = [call(n) for n in rng.sample(names, 2 if multi and turn == 0 else 1)]
        value = calls if len(calls) > 1 else calls[0]
        conv.append({"from": "function_call", "value": json.dumps(value, ensure_ascii=False)})
        for c in calls:
            conv.append({"from": "observation", "value": json.dumps({"result": len(c["name"]), "ok": True})})
        conv.append({"from": "gpt", "value": f"Done: the answer to {k} is {rng.randint(1, 99)}."})
    rec = {"conversations": conv,
           "tools": json.dumps(rng.sample(TOOLS, rng.randint(2, 3)), ensure_ascii=False)}
    if system:
        rec["system"] = "You are a careful assistant."
    return rec


tools_multi = [tool_record(k, multi=k % 3 == 0, system=False) for k in range(12)]
tools_multi[1]["tools"] = json.loads(tools_multi[1]["tools"])  # a JSON list, not a string
tools_single = [tool_record(k, multi=False, system=k % 2 == 0) for k in range(12)]
tools_single[3]["tools"] = ""  # no tools
for name, recs in (("tools_multi", tools_multi), ("tools_single", tools_single)):
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(recs, f, ensure_ascii=False, indent=1)
    registry[name] = {"file_name": f"{name}.json", "formatting": "sharegpt",
                      "columns": {"messages": "conversations", "tools": "tools", "system": "system"}}


def tool_messages(rec):
    """The record as transformers' apply_chat_template takes it: (messages, tools)."""
    msgs = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    n, pending, last = 0, collections.deque(), None
    for t in rec["conversations"]:
        if t["from"] == "function_call":
            v = json.loads(t["value"])
            calls = []
            pending.clear()
            for c in v if isinstance(v, list) else [v]:
                last = f"call{n:05d}"
                n += 1
                pending.append(last)
                calls.append({"id": last, "type": "function",
                              "function": {"name": c["name"], "arguments": c.get("arguments", {})}})
            msgs.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif t["from"] == "observation":
            msgs.append({"role": "tool", "content": t["value"],
                         "tool_call_id": pending.popleft() if pending else last})
        else:
            msgs.append({"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]})
    tools = rec.get("tools") or None
    if isinstance(tools, str):
        tools = json.loads(tools) or None
    if tools:
        tools = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools]
    return msgs, tools


def tool_row(tok, msgs, tools):
    """As chat.rs labels: each assistant turn is what the render up to it adds to the render
    before it with the generation prompt, at the same place in the whole render when that is
    a prefix, else at its first occurrence after the previous turn."""
    render = lambda m, gen: tok.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(msgs, False)
    spans, start_at = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt, turn = render(msgs[:i], True), render(msgs[: i + 1], False)
        assert turn.startswith(prompt)
        answer = turn[len(prompt):]
        start = len(prompt) if full.startswith(turn) else full.index(answer, start_at)
        spans.append((start, start + len(answer)))
        start_at = start + len(answer)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if any(a <= s < b for a, b in spans) else -100
              for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    return {"input_ids": enc["input_ids"], "labels": labels}


TOOL_MODELS = {
    "qwen25": (QWEN25, None, "<|im_end|>", ("tools_multi", "tools_single")),
    "llama31": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", ("tools_single",)),
    "mistral": (MISTRAL_V03, "<s>", "</s>", ("tools_multi",)),
}
for model_name, (template, bos_text, eos_text, sets) in TOOL_MODELS.items():
    d = os.path.join(out, f"model-{model_name}")
    os.makedirs(d, exist_ok=True)
    # The model's bos/eos are special tokens of its vocabulary, as in the real tokenizers.
    tool_tok = Tokenizer.from_file(os.path.join(ROOT, "configs/tiny/tokenizer.json"))
    tool_tok.add_special_tokens([t for t in (bos_text, eos_text) if t and tool_tok.token_to_id(t) is None])
    tool_tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos_text,
                   "eos_token": eos_text, "chat_template": template}, f, indent=2)
    t = AutoTokenizer.from_pretrained(d)
    for name in sets:
        recs = tools_multi if name == "tools_multi" else tools_single
        with open(os.path.join(out, f"expected_{name}_{model_name}.jsonl"), "w") as f:
            for rec in recs:
                f.write(json.dumps(tool_row(t, *tool_messages(rec))) + "\n")
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump(registry, f, indent=2)
print(f"data fixtures: pt rows of {len(docs)} documents, tool-calling rows for {', '.join(TOOL_MODELS)}")

# Preference pairs (training.stage: dpo): LlamaFactory's ranking records, alpaca form (the
# demo set data/demo/dpo_demo.json, some records given a `history`) and sharegpt form
# (multi-turn prompts ending with the user, `chosen` / `rejected` one message each). Each
# pair is two rows, prompt + chosen then prompt + rejected, rendered with
# apply_chat_template and labelled on the answer alone: the tokens starting between the
# render of the prompt with the generation prompt and the end.
with open(os.path.join(ROOT, "data/demo/dpo_demo.json")) as f:
    dpo_alpaca = json.load(f)
for k, r in enumerate(dpo_alpaca):
    if k % 5 == 1:
        t = alpaca[k]
        r["history"] = [["\n".join(s for s in (t["instruction"], t["input"]) if s), t["output"]]]
with open(os.path.join(out, "dpo_alpaca.json"), "w") as f:
    json.dump(dpo_alpaca, f, ensure_ascii=False, indent=1)
rng = random.Random(31)
dpo_sharegpt = []
for k, p in enumerate(dpo_alpaca[:30]):
    conv = []
    if k % 4 == 0:
        conv.append({"from": "system", "value": "Réponds brièvement ✓"})
    for t in rng.sample(alpaca, rng.randint(0, 2)):
        conv.append({"from": "human", "value": "\n".join(s for s in (t["instruction"], t["input"]) if s)})
        conv.append({"from": "gpt", "value": t["output"]})
    conv.append({"from": "human", "value": "\n".join(s for s in (p["instruction"], p["input"]) if s)})
    dpo_sharegpt.append({"conversations": conv, "chosen": {"from": "gpt", "value": p["chosen"]},
                         "rejected": {"from": "gpt", "value": p["rejected"]}})
with open(os.path.join(out, "dpo_sharegpt.jsonl"), "w") as f:
    for r in dpo_sharegpt:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
registry.update({
    "dpo_alpaca": {"file_name": "dpo_alpaca.json", "ranking": True,
                   "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                               "rejected": "rejected", "system": "system", "history": "history"}},
    "dpo_sharegpt": {"file_name": "dpo_sharegpt.jsonl", "formatting": "sharegpt", "ranking": True,
                     "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
})


def answer_row(msgs, tok=tok):
    full = tok.apply_chat_template(msgs, tokenize=False)
    prompt = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert full.startswith(prompt)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if s >= len(prompt) else -100 for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    return {"input_ids": enc["input_ids"], "labels": labels}


def ranking_prompt(r):
    if "conversations" in r:
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        return [{"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]]
    msgs = [{"role": "system", "content": r["system"]}] if r.get("system") else []
    for q, a in r.get("history", []):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": "\n".join(s for s in (r["instruction"], r["input"]) if s)}]


def answer_text(v):
    return v["value"] if isinstance(v, dict) else v


for name, recs, t in (("dpo_alpaca", dpo_alpaca, tok), ("dpo_sharegpt", dpo_sharegpt, tok),
                      ("dpo_sharegpt_template2", dpo_sharegpt, tok2)):
    with open(os.path.join(out, f"expected_{name}.jsonl"), "w") as f:
        for r in recs:
            for side in ("chosen", "rejected"):
                msgs = ranking_prompt(r) + [{"role": "assistant", "content": answer_text(r[side])}]
                f.write(json.dumps(answer_row(msgs, t)) + "\n")
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump(registry, f, indent=2)
print(f"data fixtures: preference pairs, {len(dpo_alpaca)} alpaca and {len(dpo_sharegpt)} sharegpt")

# Rollouts (training.stage: grpo) in text: the prompt as a string (a user turn) or as chat
# messages, the completion as a string or as one assistant message; each row is rendered
# with apply_chat_template and labelled on the completion alone, as a ranking answer is.
rollouts = []
for k, p in enumerate(dpo_alpaca[:12]):
    prompt = "\n".join(s for s in (p["instruction"], p["input"]) if s)
    for j, answer in enumerate((p["chosen"], p["rejected"], p["chosen"] + " ✓")):
        rec = {"reward": float(j == 0) - 0.25 * j, "group": k}
        if k % 2:
            rec["prompt"] = [{"role": "system", "content": "Réponds brièvement"},
                             {"role": "user", "content": prompt}]
            rec["completion"] = [{"role": "assistant", "content": answer}]
        else:
            rec["prompt"], rec["completion"] = prompt, answer
        rollouts.append(rec)
with open(os.path.join(out, "rollouts_text.jsonl"), "w") as f:
    for r in rollouts:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
with open(os.path.join(out, "expected_rollouts_text.jsonl"), "w") as f:
    for r in rollouts:
        msgs = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
        answer = r["completion"][0]["content"] if isinstance(r["completion"], list) else r["completion"]
        f.write(json.dumps(answer_row(msgs + [{"role": "assistant", "content": answer}])) + "\n")
print(f"data fixtures: {len(rollouts)} text rollouts")

# Built-in chat templates (src/config/chat_templates/*.jinja, `dataset.chat_template: qwen`):
# each renders conversations as LlamaFactory's template of the same name does. The
# reference is written here from LlamaFactory's definitions (hiyouga/LLaMA-Factory at
# ff6d4d1, src/llamafactory/data/template.py): the slots of `register_template(name=...)`
# ("alpaca" l. 716-724, "chatml" l. 778-787, "default" l. 909-915, "gemma" l. 1012-1024,
# "llama3" l. 1481-1506, "mistral" l. 1877-1887, "qwen" l. 2041-2054), assembled as
# `Template._encode` (l. 132-170: prefix and system before the first message, system =
# the conversation's or `default_system`) and `Llama2Template._encode` (gemma, mistral,
# l. 385-417: the formatted system put in front of the first user message's content) do;
# `{"eos_token"}` / `{"bos_token"}` slots are the tokenizer's eos / bos. LlamaFactory is
# not installed here (its dependencies are heavy), so the strings are the reference: our
# template's render (transformers' apply_chat_template with its text, jinja2) must equal
# them, its token ids (apply_chat_template(tokenize=True)) are the expected row, and a
# token is labelled when it starts inside a target (LlamaFactory's response: the
# assistant's content and its slot's end tokens).
BOS, EOS = object(), object()
LF_TEMPLATES = {
    # name: (prefix, system, user, assistant, default_system, system fused into first user)
    "qwen": ([], ["<|im_start|>system\n{c}<|im_end|>\n"],
             ["<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n"], ["{c}<|im_end|>\n"],
             "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", False),
    "chatml": ([], ["<|im_start|>system\n{c}<|im_end|>\n"],
               ["<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n"], ["{c}<|im_end|>\n"], "", False),
    "llama3": ([BOS], ["<|start_header_id|>system<|end_header_id|>\n\n{c}<|eot_id|>"],
               ["<|start_header_id|>user<|end_header_id|>\n\n{c}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n"], ["{c}<|eot_id|>"], "", False),
    "mistral": ([BOS], ["{c}\n\n"], ["[INST] {c}[/INST]"], [" {c}", EOS], "", True),
    "gemma": ([BOS], ["{c}\n\n"], ["<start_of_turn>user\n{c}<end_of_turn>\n<start_of_turn>model\n"],
              ["{c}<end_of_turn>\n"], "", True),
    "alpaca": ([], ["{c}"], ["### Instruction:\n{c}\n\n### Response:\n"], ["{c}", EOS, "\n\n"],
               "Below is an instruction that describes a task. "
               "Write a response that appropriately completes the request.\n\n", False),
    "default": ([], ["System: {c}", EOS, "\n"], ["Human: {c}", EOS, "\nAssistant:"], ["{c}", EOS, "\n"], "", False),
}
# The tokenizer of each: the tiny one with the family's special tokens added, bos / eos as
# the family's base models set them; qwen keeps the tiny model's own template (which the
# built-in replaces), the others have none (a base model).
LF_TOKENS = {
    "qwen": ([], None, "<|im_end|>"), "chatml": ([], None, "<|im_end|>"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "gemma": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
    "alpaca": ([], None, "<|im_end|>"), "default": ([], None, "<|endoftext|>"),
}


def lf_pieces(name, msgs, bos, eos):
    """LlamaFactory's encode_multiturn as text: [(prompt slots, response slots)] per turn."""
    prefix, system_f, user_f, assistant_f, default_system, fused = LF_TEMPLATES[name]
    fill = lambda slots, c: [bos if s is BOS else eos if s is EOS else s.replace("{c}", c)  # noqa: E731
                             for s in slots if not ((s is BOS and bos is None) or (s is EOS and eos is None))]
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else ""
    turns = msgs[1:] if msgs[0]["role"] == "system" else msgs
    system = system or default_system
    encoded = []
    for i, m in enumerate(turns):
        slots, sys_text = [], ""
        if i == 0:
            slots += fill(prefix, "")
            if system and fused:
                sys_text = "".join(fill(system_f, system))
            elif system:
                slots += fill(system_f, system)
        slots += fill(user_f if m["role"] == "user" else assistant_f, sys_text + m["content"] if m["role"] == "user" else m["content"])
        encoded.append(slots)
    return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


BUILTIN_CONVS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Réponds brièvement ✓"}, {"role": "user", "content": "Capitale de la France ?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Et de l'Italie ?"},
     {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "Merci"},
     {"role": "assistant", "content": "De rien !"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"},
     {"role": "user", "content": "  Another one, with spaces around  \n"},
     {"role": "assistant", "content": " Green, said with a leading space. \n"}],
    [{"role": "user", "content": "Write a haiku about {braces} and 'quotes'."},
     {"role": "assistant", "content": "Curly {braces} hold\n'quoted' words in a line—\nsilence, then the end."}],
]
with open(os.path.join(out, "builtin_chat.json"), "w") as f:
    json.dump([{"messages": m} for m in BUILTIN_CONVS], f, ensure_ascii=False, indent=1)
registry["builtin_chat"] = dict(registry["openai_demo"], file_name="builtin_chat.json")
seams = {}
for name in LF_TEMPLATES:
    with open(os.path.join(ROOT, "src/config/chat_templates", f"{name}.jinja")) as f:
        ours = f.read()
    added, bos_text, eos_text = LF_TOKENS[name]
    d = os.path.join(out, f"model-builtin-{name}")
    os.makedirs(d, exist_ok=True)
    t = Tokenizer.from_file(os.path.join(ROOT, "configs/tiny/tokenizer.json"))
    t.add_special_tokens([s for s in added if t.token_to_id(s) is None])
    t.save(os.path.join(d, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos_text, "eos_token": eos_text}
    if name == "qwen":
        with open(os.path.join(ROOT, "configs/tiny/tokenizer_config.json")) as f:
            cfg["chat_template"] = json.load(f)["chat_template"]
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    bt = AutoTokenizer.from_pretrained(d)
    seams[name] = 0
    with open(os.path.join(out, f"expected_builtin_chat_{name}.jsonl"), "w") as f:
        for msgs in BUILTIN_CONVS:
            pairs = lf_pieces(name, msgs, bos_text, eos_text)
            text = "".join(s for p in pairs for side in p for s in side)
            rendered = bt.apply_chat_template(msgs, chat_template=ours, tokenize=False)
            assert rendered == text, f"built-in {name}: ours {rendered!r}\nLlamaFactory's {text!r}"
            ids = bt.apply_chat_template(msgs, chat_template=ours, tokenize=True)["input_ids"]
            enc = bt(text, add_special_tokens=False, return_offsets_mapping=True)
            assert ids == enc["input_ids"], name
            spans, at = [], 0
            for prompt, response in pairs:
                at += len("".join(prompt))
                spans.append((at, at + len("".join(response))))
                at = spans[-1][1]
            labels = [i if any(a <= s < b for a, b in spans) else -100
                      for i, (s, _) in zip(ids, enc["offset_mapping"])]
            # LlamaFactory tokenizes each slot apart; where slots meet inside plain text
            # (alpaca, default) the ids may differ from the whole text's, never elsewhere.
            lf_ids = [i for p in pairs for side in p for s in side
                      for i in bt(s, add_special_tokens=False)["input_ids"]]
            if lf_ids != ids:
                assert name in ("alpaca", "default"), f"built-in {name}: slot seams changed the ids"
                seams[name] += 1
            f.write(json.dumps({"input_ids": ids, "labels": labels, "text": text}, ensure_ascii=False) + "\n")
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump(registry, f, indent=2)
print(f"data fixtures: built-in templates {', '.join(LF_TEMPLATES)} on {len(BUILTIN_CONVS)} conversations "
      f"(rows whose ids differ from LlamaFactory's slot-by-slot tokenization: {seams})")
# The vision-language records and Qwen2-VL rows (issue #49).
import subprocess  # noqa: E402
import sys  # noqa: E402
subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_vlm_fixtures.py"), "--out", out], check=True)

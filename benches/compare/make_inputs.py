#!/usr/bin/env python3
"""The inputs the three systems of benches/compare/run.sh share, written once per shape.

- `model/`: one random-init HF model directory (config.json from configs/, LAYERS-reduced when
  asked; bf16 safetensors in shards; a word-level tokenizer whose word `w<id>` is token id
  `<id>`, so a text of such words tokenizes to exactly the ids this project and the DeepSpeed
  driver read), loaded by all three.
- `data/tokens.jsonl`: `{"input_ids": [...]}` rows of exactly SEQ ids each (this project's
  `dataset.format: tokenized`; the DeepSpeed driver reads the same file).
- `data/megatrain/`: the same rows as an alpaca-format JSON (instruction = the first word,
  output = the rest) with the `dataset_info.json` registry the published MegaTrain's
  `ChatDataset` loads them by; its chat template joins the turns with one space, so the text
  is the SEQ words and `train_on_prompt: true` leaves every token a label, as ours.
- `data/shape.json`: what table.py needs to compute both FLOPs formulas for this shape (parameter
  counts from the tensors written, layers, attention width, batch, seq).

Usage: make_inputs.py --base-config configs/qwen2.5-7b/config.json --model-out DIR
       --data-out DIR --layers N --batch B --seq T [--rows R] [--tiny]
`--tiny` shrinks widths and vocab (for a test on a CPU machine); the files have the same form.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 2 << 30  # ~2 GiB per safetensors shard
INIT_STD = 0.02  # HF's initializer_range for Qwen2.5


def model_config(base: dict, layers: int, tiny: bool) -> dict:
    """The model's config.json: the base one with `layers` decoder layers (and small widths
    under `tiny`)."""
    c = dict(base)
    c["num_hidden_layers"] = layers
    if c.get("layer_types"):  # per-layer lists keep their first `layers` entries
        c["layer_types"] = c["layer_types"][:layers]
    if "max_window_layers" in c:
        c["max_window_layers"] = min(c["max_window_layers"], layers)
    if tiny:
        c.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
    # The pad/eos token is the last id, which the data never uses (a word-level tokenizer
    # must map each id to one word).
    c["eos_token_id"] = c["bos_token_id"] = c["pad_token_id"] = c["vocab_size"] - 1
    c["torch_dtype"] = c["dtype"] = "bfloat16"
    c["use_cache"] = False
    return c


def qwen2_tensors(c: dict):
    """(name, shape) of every tensor of a Qwen2ForCausalLM with config `c`, in HF's names."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (v, h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.q_proj.bias", (q,)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.k_proj.bias", (kv,)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.bias", (kv,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not c.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h)


def write_model(c: dict, out: Path, seed: int) -> dict:
    """Writes config.json and bf16 safetensors shards with HF's init (normal(0, 0.02)
    matrices, zero biases, unit norms); returns the parameter counts."""
    if c.get("model_type") != "qwen2":
        sys.exit(f"make_inputs.py: model_type {c.get('model_type')!r} in the base config: "
                 "only qwen2 (Qwen2.5) tensors are written here")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1) + "\n")
    gen = torch.Generator().manual_seed(seed)
    shards, cur, cur_bytes, weight_map = [], {}, 0, {}
    params = embed = 0
    for name, shape in qwen2_tensors(c):
        n = 1
        for d in shape:
            n *= d
        params += n
        if name == "model.embed_tokens.weight":
            embed = n
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
            t = t.to(torch.bfloat16)
        if cur and cur_bytes + 2 * n > SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[name] = t
        cur_bytes += 2 * n
    shards.append(cur)
    total = len(shards)
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": 2 * params}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return {"params": params, "embed_params": embed}


WORD_TOKENIZER_PY = '''"""The tokenizer.json beside this file as it is (benches/compare/make_inputs.py)."""
try:
    from transformers import TokenizersBackend
except ImportError:  # transformers 4
    from transformers import PreTrainedTokenizerFast as TokenizersBackend


class WordTokenizer(TokenizersBackend):
    pass
'''


def write_tokenizer(c: dict, out: Path):
    """A word-level tokenizer: `w<id>` is id `<id>` for every id below vocab_size - 1, and
    `<|pad|>` (the last id) is the pad and eos token; the chat template joins the turns'
    contents with one space."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    v = c["vocab_size"]
    vocab = {f"w{i}": i for i in range(v - 1)}
    vocab["<|pad|>"] = v - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|pad|>"])
    tok.save(str(out / "tokenizer.json"))
    template = ("{% for m in messages %}{% if not loop.first %} {% endif %}"
                "{{ m['content'] }}{% endfor %}")
    # transformers 5 maps model_type qwen2 to its byte-level BPE Qwen2Tokenizer whatever
    # tokenizer_class says; a class of our own (auto_map, loaded under trust_remote_code,
    # which MegaTrain's train.py passes) keeps tokenizer.json's word-level model.
    (out / "word_tokenizer.py").write_text(WORD_TOKENIZER_PY)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "WordTokenizer",
        "auto_map": {"AutoTokenizer": [None, "word_tokenizer.WordTokenizer"]},
        "eos_token": "<|pad|>", "pad_token": "<|pad|>", "unk_token": "<|pad|>",
        "model_max_length": 1 << 20, "padding_side": "right", "chat_template": template,
    }, indent=1) + "\n")


def write_data(c: dict, out: Path, rows: int, seq: int, seed: int):
    """The token rows (ids in [0, vocab_size - 1)) as our tokenized JSONL and as MegaTrain's
    alpaca JSON with its dataset_info.json."""
    rng = random.Random(seed)
    top = c["vocab_size"] - 1
    data = [[rng.randrange(top) for _ in range(seq)] for _ in range(rows)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tokens.jsonl", "w") as f:
        for ids in data:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    mt = out / "megatrain"
    mt.mkdir(exist_ok=True)
    words = lambda ids: " ".join(f"w{i}" for i in ids)
    json.dump([{"instruction": words(ids[:1]), "input": "", "output": words(ids[1:])}
               for ids in data], open(mt / "synthetic.json", "w"))
    json.dump({"synthetic": {"file_name": "synthetic.json", "formatting": "alpaca"}},
              open(mt / "dataset_info.json", "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-config", required=True)
    ap.add_argument("--model-out", required=True, help="the model directory")
    ap.add_argument("--data-out", required=True, help="the datasets and shape.json")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--rows", type=int, help="dataset rows (default: batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    model_out, data_out = Path(a.model_out), Path(a.data_out)
    c = model_config(json.load(open(a.base_config)), a.layers, a.tiny)

    # Each directory is kept where it holds what is asked (a warm machine reuses the 15 GB
    # model); its marker file, written last, says it is complete.
    model_marker = model_out / "params.json"
    if model_marker.exists() and json.load(open(model_marker)).get("config") == c:
        counts = json.load(open(model_marker))["counts"]
        print(f"make_inputs.py: {model_out} already holds this model", file=sys.stderr)
    else:
        model_marker.unlink(missing_ok=True)
        counts = write_model(c, model_out, a.seed)
        write_tokenizer(c, model_out)
        model_marker.write_text(json.dumps({"config": c, "counts": counts}, indent=1) + "\n")

    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    shape = {
        "model": Path(a.base_config).parent.name + ("-tiny" if a.tiny else ""),
        "base_config": a.base_config, "model_dir": str(model_out.resolve()),
        "layers": a.layers, "batch": a.batch, "seq": a.seq, "rows": a.rows or a.batch,
        "seed": a.seed, "vocab_size": c["vocab_size"], **counts,
        # Model FLOPs count the matmul parameters: all but a looked-up (untied) embedding.
        "matmul_params": counts["params"] - (0 if c.get("tie_word_embeddings") else counts["embed_params"]),
        "attention_layers": a.layers,
        "attn_width": c["num_attention_heads"] * hd,
    }
    data_marker = data_out / "shape.json"
    if data_marker.exists() and json.load(open(data_marker)) == shape:
        print(f"make_inputs.py: {data_out} already holds these rows", file=sys.stderr)
    else:
        data_marker.unlink(missing_ok=True)
        write_data(c, data_out, shape["rows"], a.seq, a.seed)
        data_marker.write_text(json.dumps(shape, indent=1) + "\n")
    print(json.dumps(shape))


if __name__ == "__main__":
    main()

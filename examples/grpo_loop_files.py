"""GRPO as a user runs it with megatrain-rs: the generator and the reward live in Python,
the training step in `mt-launch` (training.stage: grpo). Each iteration:

  1. generate: G completions of each of P prompts with the current model (an HF directory):
     vLLM when installed with a GPU (--engine vllm; not exercised on the CPU box this was
     measured on), else transformers' `generate` (SGLang is not wired in yet);
  2. score each with `reward(prompt, completion, answer)` from a Python file (--reward);
  3. write the rollouts (token ids as generated, reward, group) as JSONL;
  4. train: `mt-launch --resume latest` runs the next `--steps` optimizer steps on them (the
     Adam state carries over) and exports the model for the next iteration.

The demo: the tiny model of configs/tiny (random init) on the "Add a and b." prompts of
data/demo/alpaca_demo.json with examples/grpo_reward.py; the mean reward per iteration is
printed and written to WORK/rewards.json.

  .venv/bin/python examples/grpo_loop.py --work /tmp/grpo_loop --iterations 24
"""
import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_reward(path):
    spec = importlib.util.spec_from_file_location("reward_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reward


def arithmetic_prompts():
    with open(os.path.join(ROOT, "data/demo/alpaca_demo.json")) as f:
        records = json.load(f)
    out = []
    for r in records:
        m = re.fullmatch(r"Add (\d+) and (\d+)\.", r["instruction"])
        if m:
            out.append((r["instruction"], int(m[1]) + int(m[2])))
    return out


def initial_model(out, seed):
    """configs/tiny at random init (as `model.init: random` would), saved as an HF dir."""
    src = os.path.join(ROOT, "configs/tiny")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(src))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), out)


def generate(model_dir, tok, prompts, g, max_new_tokens, engine, seed):
    """[(prompt ids, [completion ids] * g)] for each prompt."""
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=model_dir, seed=seed)
        params = SamplingParams(n=g, temperature=1.0, max_tokens=max_new_tokens)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
        return [(ids, [list(c.token_ids) for c in o.outputs]) for ids, o in zip(prompt_ids, outs)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    result = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                               max_new_tokens=max_new_tokens, num_return_sequences=g,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        completions = []
        for row in y[:, len(ids):].tolist():
            if tok.eos_token_id in row:  # up to and including the end of turn
                row = row[: row.index(tok.eos_token_id) + 1]
            completions.append(row)
        result.append((ids, completions))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/grpo_loop")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per iteration (P)")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (G, a group)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--reward", default=os.path.join(ROOT, "examples/grpo_reward.py"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/tiny_grpo.yaml"))
    ap.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto")
    ap.add_argument("--launcher", default=os.path.join(ROOT, "target/release/mt-launch"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = args.engine
    if engine == "auto":
        engine = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "transformers"
    reward_fn = load_reward(args.reward)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    model_dir = os.path.join(args.work, "model-0")
    initial_model(model_dir, args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pool = arithmetic_prompts()
    rng = random.Random(args.seed)
    n = args.prompts * args.generations
    assert n % args.steps == 0, "completions per iteration must split into --steps batches"
    history = []
    for it in range(args.iterations):
        t0 = time.time()
        chosen = [pool[rng.randrange(len(pool))] for _ in range(args.prompts)]
        gens = generate(model_dir, tok, [p for p, _ in chosen], args.generations, args.max_new_tokens, engine,
                        args.seed * 1000 + it)
        rollouts, rewards = [], []
        for k, ((prompt, answer), (ids, completions)) in enumerate(zip(chosen, gens)):
            for c in completions:
                r = float(reward_fn(prompt, tok.decode(c, skip_special_tokens=True), answer))
                rewards.append(r)
                rollouts.append({"prompt_ids": ids, "completion_ids": c, "reward": r, "group": f"{it}-{k}"})
        path = os.path.join(args.work, f"rollouts-{it}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rollouts)
        t1 = time.time()
        nxt = os.path.join(args.work, f"model-{it + 1}")
        cmd = [args.launcher, "--config", args.config, "--gpus", "0", "--workers", "1",
               "--metrics-out", os.path.join(args.work, f"metrics-{it}.jsonl"),
               "--set", f"model.path={os.path.join(args.work, 'model-0')}", "--set", "model.init=pretrained",
               "--set", f"dataset.path={path}",
               "--set", f"training.batch_size={n // args.steps}",
               "--set", f"training.num_steps={(it + 1) * args.steps}",
               "--set", f"checkpoint.dir={os.path.join(args.work, 'ck')}",
               "--set", f"training.output_dir={nxt}"]
        if it > 0:
            cmd += ["--resume", "latest"]
        log = subprocess.run(cmd, capture_output=True, text=True)
        if log.returncode != 0:
            sys.exit(f"mt-launch failed:\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(model_dir, name), nxt)
        if it > 0:
            shutil.rmtree(model_dir)
        model_dir = nxt
        mean = sum(rewards) / len(rewards)
        solved = sum(r == 1.0 for r in rewards) / len(rewards)
        history.append({"iteration": it, "mean_reward": mean, "solved": solved,
                        "generate_s": round(t1 - t0, 2), "train_s": round(time.time() - t1, 2)})
        print(f"iteration {it:3d}  mean reward {mean:.4f}  solved {solved:.3f}  "
              f"generate {t1 - t0:.1f}s  train {time.time() - t1:.1f}s ({engine})", flush=True)
    with open(os.path.join(args.work, "rewards.json"), "w") as f:
        json.dump(history, f, indent=1)


if __name__ == "__main__":
    main()

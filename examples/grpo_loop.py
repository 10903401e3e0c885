"""GRPO as a user runs it with megatrain-rs, on one persistent engine: the generator and the
reward live in Python, the training step in `mt-launch serve` (megatrain.Engine, started
once for the whole loop). Each iteration:

  1. weights: the rollout model takes the engine's current weights from its shared store,
     in place, with no disk in between: transformers' model gets them by `copy_` into its
     parameters (a memcpy per tensor; the model keeps float32 parameters of its own, which a
     float32 `generate` needs anyway), vLLM (--engine vllm, where installed with a GPU; not
     exercised on the CPU box this was measured on) through its model's `load_weights`;
  2. generate: G completions of each of P prompts (transformers' `generate`, or vLLM);
  3. score each with `reward(prompt, completion, answer)` from a Python file (--reward);
  4. train: the rollouts (token ids as generated, reward, group) go to the engine in
     --steps batches of whole groups (so each group-relative advantage is the one the whole
     iteration gives), one `train_step` and one `optimizer_step` each; the Adam state stays
     in the engine. With --beta > 0 (the KL term), a second engine holding the initial model
     gives each batch's reference log-probabilities (forward only, once per batch).

Nothing is written to disk but WORK/model-0 (the initial model: the engine's model.path, and
the rollout model's config and tokenizer), a checkpoint every --save-every iterations, the
final model (WORK/final, an HF directory) and WORK/rewards.json. examples/grpo_loop_files.py
is the same loop through files (a `mt-launch --resume latest` per iteration), kept to compare
the two curves.

The demo: the tiny model of configs/tiny (random init) on the "Add a and b." prompts of
data/demo/alpaca_demo.json with examples/grpo_reward.py; the mean reward per iteration is
printed and written to WORK/rewards.json.

  .venv/bin/python examples/grpo_loop.py --work /tmp/grpo_engine --iterations 24
"""
import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))  # megatrain without `pip install -e python`
sys.path.insert(0, os.path.join(ROOT, "examples"))
import megatrain  # noqa: E402
from grpo_loop_files import arithmetic_prompts, initial_model, load_reward  # noqa: E402


def chat_ids(tok, prompts):
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for p in prompts]


class TransformersRollout:
    """transformers' `generate` on a float32 model whose parameters take the engine's
    weights in place."""

    def __init__(self, model_dir, tok):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tok = tok

    def load(self, engine):
        return engine.copy_weights_to(self.model)  # seqlocked: a whole update, never half

    def generate(self, prompt_ids, g, max_new_tokens, seed):
        torch.manual_seed(seed)
        result = []
        for ids in prompt_ids:
            x = torch.tensor([ids])
            with torch.no_grad():
                y = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0,
                                        top_k=0, max_new_tokens=max_new_tokens, num_return_sequences=g,
                                        pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
            completions = []
            for row in y[:, len(ids):].tolist():
                if self.tok.eos_token_id in row:  # up to and including the end of turn
                    row = row[: row.index(self.tok.eos_token_id) + 1]
                completions.append(row)
            result.append((ids, completions))
        return result


class VllmRollout:
    """vLLM in this process (V1's engine core not in a subprocess, so its model is reachable
    here), its weights replaced through the model's `load_weights` from the store's views."""

    def __init__(self, model_dir, seed):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=model_dir, seed=seed)

    def load(self, engine):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
        while True:
            v = engine.weights_version()
            worker.model_runner.model.load_weights(weights=engine.state_dict_views())
            if engine.views_consistent(v):
                return v

    def generate(self, prompt_ids, g, max_new_tokens, seed):
        from vllm import SamplingParams

        params = SamplingParams(n=g, temperature=1.0, max_tokens=max_new_tokens, seed=seed)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
        return [(ids, [list(c.token_ids) for c in o.outputs]) for ids, o in zip(prompt_ids, outs)]


def with_reference(ref, batch):
    """`batch` with each rollout's `ref_logps`: its completion tokens' log-probabilities under
    the initial model, from the reference engine (forward only)."""
    rows = [{"input_ids": r["prompt_ids"] + r["completion_ids"],
             "labels": [-100] * len(r["prompt_ids"]) + r["completion_ids"]} for r in batch]
    logps = ref.forward_logprobs(rows)
    return [dict(r, ref_logps=lp.tolist()) for r, lp in zip(batch, logps)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/grpo_loop")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per iteration (P)")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (G, a group)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration (P must split into them)")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--reward", default=os.path.join(ROOT, "examples/grpo_reward.py"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/tiny_grpo.yaml"))
    ap.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto")
    ap.add_argument("--launcher", default=None, help="mt-launch (default: target/release, $MT_LAUNCH, PATH)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--beta", type=float, default=None,
                    help="grpo.beta (default: the config's): > 0 adds the KL term to the initial model")
    ap.add_argument("--save-every", type=int, default=0, help="a checkpoint every N iterations (0: none)")
    args = ap.parse_args()
    kind = args.engine
    if kind == "auto":
        kind = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "transformers"
    if args.prompts % args.steps:
        sys.exit(f"--prompts {args.prompts} must split into --steps {args.steps} batches of whole groups")
    reward_fn = load_reward(args.reward)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    model_dir = os.path.join(args.work, "model-0")
    initial_model(model_dir, args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pool = arithmetic_prompts()
    longest = max(len(ids) for ids in chat_ids(tok, [p for p, _ in pool])) + args.max_new_tokens
    per_batch = args.prompts // args.steps * args.generations
    overrides = {"model.path": model_dir, "model.init": "pretrained", "training.batch_size": per_batch,
                 "training.num_steps": args.iterations * args.steps, "dataset.max_seq_len": longest}
    if args.beta is not None:
        overrides["grpo.beta"] = args.beta

    def start(name):
        """An engine on the config, with its own checkpoint and output directories."""
        return megatrain.Engine(args.config, gpus=args.gpus, workers=args.workers, launcher=args.launcher,
                                log=os.path.join(args.work, f"{name}.log"),
                                overrides=dict(overrides, **{"checkpoint.dir": os.path.join(args.work, f"{name}-ck"),
                                                             "training.output_dir": os.path.join(args.work, name)}))

    engine = start("engine")
    ref = start("reference") if args.beta else None
    rollout = VllmRollout(model_dir, args.seed) if kind == "vllm" else TransformersRollout(model_dir, tok)
    rng = random.Random(args.seed)
    history = []
    for it in range(args.iterations):
        t0 = time.time()
        version = rollout.load(engine)
        t1 = time.time()
        chosen = [pool[rng.randrange(len(pool))] for _ in range(args.prompts)]
        gens = rollout.generate(chat_ids(tok, [p for p, _ in chosen]), args.generations, args.max_new_tokens,
                                args.seed * 1000 + it)
        groups, rewards = [], []
        for k, ((prompt, answer), (ids, completions)) in enumerate(zip(chosen, gens)):
            group = []
            for c in completions:
                r = float(reward_fn(prompt, tok.decode(c, skip_special_tokens=True), answer))
                rewards.append(r)
                group.append({"prompt_ids": ids, "completion_ids": c, "reward": r, "group": f"{it}-{k}"})
            groups.append(group)
        t2 = time.time()
        per = args.prompts // args.steps
        steps = []
        for s in range(args.steps):
            batch = [r for g in groups[s * per:(s + 1) * per] for r in g]
            if ref is not None:
                batch = with_reference(ref, batch)
            out = engine.train_step(rollouts=batch)
            upd = engine.optimizer_step()
            steps.append({"loss": out["loss"], "grad_norm": upd["grad_norm"], "step": upd["step"]})
        if args.save_every and (it + 1) % args.save_every == 0:
            engine.save()
        t3 = time.time()
        mean = sum(rewards) / len(rewards)
        solved = sum(r == 1.0 for r in rewards) / len(rewards)
        history.append({"iteration": it, "mean_reward": mean, "solved": solved, "weights_version": version,
                        "steps": steps, "weights_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 2),
                        "train_s": round(t3 - t2, 2)})
        print(f"iteration {it:3d}  mean reward {mean:.4f}  solved {solved:.3f}  weights {t1 - t0:.3f}s  "
              f"generate {t2 - t1:.1f}s  train {t3 - t2:.1f}s ({kind})", flush=True)
    engine.export(os.path.join(args.work, "final"))
    with open(os.path.join(args.work, "rewards.json"), "w") as f:
        json.dump(history, f, indent=1)
    engine.shutdown()
    if ref is not None:
        ref.shutdown()


if __name__ == "__main__":
    main()

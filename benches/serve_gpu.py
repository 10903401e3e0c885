#!/usr/bin/env python3
"""What an RL iteration costs on the persistent engine (`mt-launch serve`, python/megatrain)
against today's restart path (`mt-launch --resume latest` per batch of rollouts), measured
in one call on a GPU machine (issue #48, part 5).

The engine path, per iteration, on a random-init model of the config's architecture with
`--layers` of its layers (all by default), GRPO on `--rollouts` rollouts of `--seq`
tokens (half prompt, half completion):
  views     the store handed to a generator: `state_dict_views()` (memfd mapped, no copy)
            and every tensor copied into the generator's GPU tensors (what a colocated
            rollout engine's load_weights does);
  forward   forward-only log-probabilities of the rollouts (the reference / old log-probs);
  train     `train_step` of the rollouts and `optimizer_step`.
Then `sleep`: the device memory it frees, shown by allocating it from this process (a
rollout engine's turn), and `wake`.

The restart path, measured on the same shape: a launch's start-up (to the workers' ready
line), and a checkpoint's write and its resume's read, measured on `--ckpt-layers` layers
and scaled by bytes to the model (the disk of the GPU machines holds no full 7B
checkpoint): what each iteration of examples/grpo_loop_files.py pays besides its step.

Writes a Markdown table to --out (benches/results/serve_<model>_<machine>_<date>.md).

  python3 benches/serve_gpu.py --config configs/bench/qwen_7b.yaml --gpus 1 --out FILE
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import megatrain  # noqa: E402


def model_dir(config, layers, work):
    """The config's model directory, with `layers` layers when given (a copy of config.json)."""
    text = open(config).read()
    path = re.search(r"^  path: *(\S+)", text, re.M).group(1)
    src = os.path.normpath(os.path.join(os.path.dirname(config), path))
    cfg = json.load(open(os.path.join(src, "config.json")))
    if layers:
        cfg["num_hidden_layers"] = layers
        if cfg.get("layer_types"):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    out = os.path.join(work, os.path.basename(src), f"{cfg['num_hidden_layers']}L")
    os.makedirs(out, exist_ok=True)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    return out, cfg


def serve_config(path, model, args, data=None):
    """The run's config: GRPO on `data` (a rollouts file; none for a server)."""
    dataset = f"path: {data}, " if data else ""
    with open(path, "w") as f:
        f.write(f"""model: {{path: {model}, init: random, dtype: {args.dtype}}}
dataset: {{{dataset}max_seq_len: {args.seq}}}
training:
  stage: grpo
  batch_size: {args.rollouts}
  gradient_accumulation_steps: {max(1, args.rollouts // args.micro)}
  num_steps: 1000
  learning_rate: 1.0e-6
  weight_decay: 0.0
  max_grad_norm: 1.0
  save_model: false
memory:
  master_weights: {args.master}
  grad_dtype: {args.grad}
  moments_dtype: {args.moments}
  ce_chunk_tokens: 8192
grpo: {{loss_type: dapo, beta: 0.0}}
""")


def rollouts(n, seq, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    half = seq // 2
    ids = torch.randint(0, vocab, (n, seq), generator=g).tolist()
    rewards = torch.rand(n, generator=g).tolist()
    return [{"prompt_ids": r[:half], "completion_ids": r[half:], "reward": w, "group": i // 8}
            for i, (r, w) in enumerate(zip(ids, rewards))]


def gpu_used():
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_path(args, work, model, cfg):
    config = os.path.join(work, "serve.yaml")
    serve_config(config, model, args)
    t = time.time()
    engine = megatrain.Engine(config, gpus=args.gpus, launcher=args.launcher,
                              log=os.path.join(work, "serve.log"), startup_timeout=900)
    startup = time.time() - t
    batch = rollouts(args.rollouts, args.seq, cfg["vocab_size"], 0)
    rows = [{"input_ids": r["prompt_ids"] + r["completion_ids"],
             "labels": [-100] * len(r["prompt_ids"]) + r["completion_ids"]} for r in batch]
    # The generator's copy of the weights on the GPU, allocated once (as a rollout engine's).
    views = list(engine.state_dict_views())
    target = {name: torch.empty(v.shape, dtype=v.dtype, device=device()) for name, v in views}
    weight_bytes = sum(v.numel() * v.element_size() for _, v in views)
    its = []
    for it in range(args.iterations):
        r = {}
        t = time.time()
        version = engine.weights_version()
        views = list(engine.state_dict_views())
        r["views_map_s"] = time.time() - t
        t = time.time()
        for name, v in views:
            target[name].copy_(v, non_blocking=False)
        sync()
        assert engine.views_consistent(version)
        r["views_copy_s"] = time.time() - t
        t = time.time()
        engine.forward_logprobs(rows)
        r["forward_s"] = time.time() - t
        t = time.time()
        engine.train_step(rollouts=batch)
        r["train_step_s"] = time.time() - t
        t = time.time()
        engine.optimizer_step()
        r["optimizer_step_s"] = time.time() - t
        its.append(r)
        print(f"engine iteration {it}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    del target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    awake = gpu_used()
    t = time.time()
    engine.sleep()
    sleep_s = time.time() - t
    asleep = gpu_used()
    # A rollout engine's turn: take what the workers gave back.
    freed = awake - asleep
    took = 0
    if torch.cuda.is_available():
        block = torch.empty(int(freed * 0.95), dtype=torch.uint8, device="cuda")
        took = block.numel()
        del block
        torch.cuda.empty_cache()
    t = time.time()
    engine.wake()
    wake_s = time.time() - t
    engine.shutdown()
    return {
        "startup_s": startup, "iterations": its, "weight_bytes": weight_bytes,
        "gpu_awake_bytes": awake, "gpu_asleep_bytes": asleep, "allocated_while_asleep": took,
        "sleep_s": sleep_s, "wake_s": wake_s,
    }


def launch(args, config, work, extra, tag):
    """One `mt-launch` run; its start-up line and checkpoint lines."""
    cmd = [args.launcher, "--config", config, "--gpus", str(args.gpus)] + extra
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    log = out.stdout + out.stderr
    open(os.path.join(work, f"{tag}.log"), "w").write(log)
    if out.returncode != 0:
        sys.exit(f"{tag} failed:\n{log[-3000:]}")
    startup = re.search(r"start-up ([\d.]+)s: .*weights ([\d.]+)s \(([^)]*)\)", log)
    written = re.search(r"written: ([\d.]+) GB in ([\d.]+)s", log)
    return {"wall_s": wall, "startup_s": float(startup.group(1)), "weights_s": float(startup.group(2)),
            "weights": startup.group(3),
            "ckpt_gb": float(written.group(1)) if written else None,
            "ckpt_write_s": float(written.group(2)) if written else None}


def restart_path(args, work, cfg):
    """A launch of the full shape (start-up), and a checkpoint written and resumed on
    --ckpt-layers layers."""
    model, _ = model_dir(args.config, args.layers, work)
    config = os.path.join(work, "run.yaml")
    data = os.path.join(work, "rollouts.jsonl")
    with open(data, "w") as f:
        for r in rollouts(args.rollouts, args.seq, cfg["vocab_size"], 1):
            f.write(json.dumps(r) + "\n")
    serve_config(config, model, args, data)
    full = launch(args, config, work, ["--set", "training.num_steps=1"], "restart-full")
    small, _ = model_dir(args.config, args.ckpt_layers, work)
    text = open(config).read().replace(model, small)
    small_cfg = os.path.join(work, "run-small.yaml")
    open(small_cfg, "w").write(text)
    ck = os.path.join(work, "ck")
    first = launch(args, small_cfg, work, ["--set", "training.num_steps=1", "--set", f"checkpoint.dir={ck}",
                                           "--set", "checkpoint.background=false"], "restart-ckpt")
    resumed = launch(args, small_cfg, work, ["--set", "training.num_steps=2", "--set", f"checkpoint.dir={ck}",
                                             "--set", "checkpoint.background=false", "--resume", "latest"],
                     "restart-resume")
    return {"full": full, "ckpt": first, "resume": resumed}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/bench/qwen_7b.yaml"))
    ap.add_argument("--layers", type=int, default=0, help="layers of the model (0: all)")
    ap.add_argument("--ckpt-layers", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--master", default="split", help="memory.master_weights")
    ap.add_argument("--moments", default="bfloat16", help="memory.moments_dtype")
    ap.add_argument("--grad", default="bfloat16", help="memory.grad_dtype")
    ap.add_argument("--dtype", default="bfloat16", help="model.dtype")
    ap.add_argument("--launcher", default=os.path.join(ROOT, "target/release/mt-launch"))
    ap.add_argument("--machine", default="H200")
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="serve-gpu-")
    model, cfg = model_dir(args.config, args.layers, work)
    layers = cfg["num_hidden_layers"]
    e = engine_path(args, work, model, cfg)
    r = None if args.skip_restart else restart_path(args, work, cfg)
    its = e["iterations"][1:] or e["iterations"]  # the first warms up
    mean = {k: sum(i[k] for i in its) / len(its) for k in its[0]}
    gb = e["weight_bytes"] / 1e9
    lines = [
        f"# The persistent engine against the restart path: {os.path.basename(os.path.dirname(model))} shape, "
        f"{layers} layers, {args.machine}, {time.strftime('%Y-%m-%d')}",
        "",
        f"`python3 benches/serve_gpu.py --config {os.path.relpath(args.config, ROOT)} --layers {args.layers} "
        f"--rollouts {args.rollouts} --seq {args.seq} --gpus {args.gpus} --master {args.master} --moments {args.moments}` "
        f"(GRPO, dapo, {args.rollouts} rollouts x {args.seq} tokens, micro-batches of {args.micro}; "
        f"mean of iterations 2..{args.iterations})",
        "",
        "| engine path, per iteration | seconds |",
        "|---|---|",
        f"| weights to the generator: views mapped (zero-copy) | {mean['views_map_s']:.4f} |",
        f"| weights to the generator: {gb:.2f} GB copied into its GPU tensors | {mean['views_copy_s']:.2f} ({gb / mean['views_copy_s']:.1f} GB/s) |",
        f"| forward-only log-probs of the rollouts | {mean['forward_s']:.2f} |",
        f"| train_step | {mean['train_step_s']:.2f} |",
        f"| optimizer_step | {mean['optimizer_step_s']:.2f} |",
        f"| server start-up (once, not per iteration) | {e['startup_s']:.1f} |",
        "",
        "| sleep / wake | |",
        "|---|---|",
        f"| device memory used, workers awake (whole GPU, after the generator's copy is freed) | {e['gpu_awake_bytes'] / 1e9:.1f} GB |",
        f"| ... asleep | {e['gpu_asleep_bytes'] / 1e9:.1f} GB |",
        f"| allocated by this process while asleep (a rollout engine's turn) | {e['allocated_while_asleep'] / 1e9:.1f} GB |",
        f"| sleep / wake | {e['sleep_s']:.1f} s / {e['wake_s']:.1f} s |",
    ]
    if r:
        small_bytes = r["ckpt"]["ckpt_gb"] or 0.0
        scale = layers / args.ckpt_layers
        write_s = (r["ckpt"]["ckpt_write_s"] or 0.0) * scale
        read_s = r["resume"]["weights_s"] * scale
        per_it = r["full"]["startup_s"] + write_s + read_s
        engine_over = mean["views_copy_s"]
        lines += [
            "",
            "| restart path, per iteration (examples/grpo_loop_files.py) | seconds |",
            "|---|---|",
            f"| a launch's start-up, {layers} layers (random init: no weights read) | {r['full']['startup_s']:.1f} |",
            f"| checkpoint write, {small_bytes:.1f} GB on {args.ckpt_layers} layers, scaled x{scale:.1f} by bytes | {write_s:.1f} |",
            f"| resume's checkpoint read ({r['resume']['weights']}), scaled x{scale:.1f} | {read_s:.1f} |",
            f"| **overhead per iteration** | **{per_it:.1f}** (engine path: {engine_over:.1f} s of weight hand-over; {per_it / max(engine_over, 1e-9):.0f}x) |",
        ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    open(args.out, "w").write(text)
    print(text)
    print(json.dumps({"engine": e, "restart": r}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU, on one GPU: the driver
benches/compare/run.sh times beside this project and the published MegaTrain.

The model is the HF transformers one (AutoModelForCausalLM from the shared model directory,
bf16, SDPA attention, gradient checkpointing without re-entrance), built under
`HfDeepSpeedConfig` so that `from_pretrained` partitions it as it loads (what the HF
Trainer's DeepSpeed integration does). The ZeRO-3 buckets take the values the HF Trainer
fills in for "auto": reduce bucket hidden², prefetch bucket 0.9 hidden², parameter
persistence threshold 10 hidden. DeepSpeed keeps fp32 master weights and Adam moments on
the host under bf16 (its default). The optimizer is DeepSpeedCPUAdam (`--optimizer
cpu_adam`, AdamW mode), or torch's AdamW on the host where CPUAdam does not build there
(`--optimizer torch_adamw`).

Each step is one micro-batch of `--batch` rows of the tokenized JSONL (`{"input_ids": [...]}`,
labels = inputs; HF shifts them), forward + backward + step, timed between CUDA syncs.
One JSON line per step goes to `--metrics` (after a first line with the set-up).
"""

import argparse
import json
import os
import sys
import time

import torch


def ds_config(hidden: int, batch: int, optimizer: str, args) -> dict:
    c = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    adam = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    if optimizer == "cpu_adam":
        # Under offload_optimizer, DeepSpeed builds DeepSpeedCPUAdam (adamw_mode) for this.
        c["optimizer"] = {"type": "AdamW", "params": adam}
    else:
        c["zero_allow_untested_optimizer"] = True
        c["zero_force_ds_cpu_optimizer"] = False
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--optimizer", choices=["cpu_adam", "torch_adamw"], required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    args = ap.parse_args()
    t_start = time.perf_counter()

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}.items():
        os.environ.setdefault(k, v)
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    rows = []
    with open(args.data) as f:
        for line in f:
            ids = json.loads(line)["input_ids"]
            if len(ids) != args.seq:
                sys.exit(f"zero3.py: {args.data}: a row of {len(ids)} tokens, not --seq {args.seq}")
            rows.append(ids)
            if len(rows) == args.batch:
                break
    if len(rows) < args.batch:
        sys.exit(f"zero3.py: {args.data} holds {len(rows)} rows, fewer than --batch {args.batch}")

    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)
    hidden = AutoConfig.from_pretrained(args.model).hidden_size
    config = ds_config(hidden, args.batch, args.optimizer, args)
    # Kept alive until the model is built: from_pretrained then loads under zero.Init.
    hf_ds = HfDeepSpeedConfig(config)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    client_opt = None
    if args.optimizer == "torch_adamw":
        client_opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                       eps=1e-8, weight_decay=0.0)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_opt, config=config)
    del hf_ds
    inner = getattr(optimizer, "optimizer", optimizer)
    x = torch.tensor(rows, dtype=torch.long, device=engine.device)

    out = open(args.metrics, "w")
    out.write(json.dumps({
        "event": "ready", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "optimizer": type(inner).__name__, "batch": args.batch, "seq": args.seq,
        "startup_s": time.perf_counter() - t_start, "ds_config": config}) + "\n")
    out.flush()
    torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        m = {"step": step, "loss": loss.item(), "step_time_s": t3 - t0, "forward_s": t1 - t0,
             "backward_s": t2 - t1, "optimizer_s": t3 - t2,
             "gpu_max_allocated_bytes": torch.cuda.max_memory_allocated(),
             "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved()}
        out.write(json.dumps(m) + "\n")
        out.flush()
        print(f"step {step}: loss {m['loss']:.4f} {m['step_time_s']:.2f} s "
              f"(fwd {m['forward_s']:.2f} bwd {m['backward_s']:.2f} opt {m['optimizer_s']:.2f})",
              flush=True)


if __name__ == "__main__":
    main()

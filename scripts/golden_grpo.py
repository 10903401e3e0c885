"""GRPO golden cases for scripts/make_golden.py (training.stage: grpo): a tiny model of a
golden family trained a few steps on a rollouts file by TRL's GRPOTrainer loss formulas
(`_compute_loss`, token-level importance sampling) in torch (float32), for
launcher/tests/grpo.rs; the `*_kl` cases with a KL term (beta > 0) against the reference
model, the initial one (a copy of the model before step 1, as TRL's `ref_model`).

Per case, under OUT/grpo/<case>/: model/ (save_pretrained), rollouts.jsonl (token-id
rollouts: `prompt_ids`, `completion_ids`, `reward`, `group`; groups of three), run.yaml,
expected.json (per step: the loss, the pre-clip gradient norm, TRL's clip_ratio/low_mean and
clip_ratio/high_mean, and with beta > 0 TRL's kl) and grads0.safetensors (every parameter's
gradient at step 1).

TRL's semantics written here as the test's reference: advantages = reward - group mean,
divided by (unbiased std + 1e-4) of the group (`scale_rewards: group`) or of every reward
(`batch`), or not (`none`); step s trains on batch s // num_iterations (file order); the old
log-probabilities are the batch's first step's (ratio 1 there); per-token loss
-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), plus with beta > 0 beta k3, where
k3 = exp(ref - logp) - (ref - logp) - 1 and ref is the token's log-probability under the
reference model (computed without grad, in a forward of its own); `grpo` means over each
completion's tokens then over completions, `dapo` divides the sum by the batch's completion
tokens, `dr_grpo` by completions x max_completion_length; TRL's `kl` is the mean k3 over the
step's completion tokens.
"""
import copy

import torch

import golden_common as c
import make_golden as g

GRPO_CASES = {
    "llama_dapo": dict(model_type="llama", config=dict(tie_word_embeddings=False), loss="dapo",
                       epsilon=0.2, epsilon_high=0.28, iterations=2, scale="group", max_len=256),
    "qwen3_tied_grpo": dict(model_type="qwen3", config=dict(head_dim=10, tie_word_embeddings=True), loss="grpo",
                            epsilon=0.1, epsilon_high=0.1, iterations=3, scale="batch", max_len=256),
    "llama_dr_grpo": dict(model_type="llama", config=dict(tie_word_embeddings=False), loss="dr_grpo",
                          epsilon=0.2, epsilon_high=0.2, iterations=1, scale="none", max_len=12),
    # With a KL term, one per loss type. The policy leaves the reference from step 2 on; beta
    # is large enough that the KL term's gradient is a few percent of the step's.
    "llama_dapo_kl": dict(model_type="llama", config=dict(tie_word_embeddings=False), loss="dapo",
                          epsilon=0.2, epsilon_high=0.28, iterations=2, scale="group", max_len=256, beta=0.5),
    "qwen3_tied_grpo_kl": dict(model_type="qwen3", config=dict(head_dim=10, tie_word_embeddings=True), loss="grpo",
                               epsilon=0.1, epsilon_high=0.1, iterations=3, scale="batch", max_len=256, beta=1.0),
    "llama_dr_grpo_kl": dict(model_type="llama", config=dict(tie_word_embeddings=False), loss="dr_grpo",
                             epsilon=0.2, epsilon_high=0.2, iterations=1, scale="none", max_len=12, beta=0.3),
}
GROUP = 3
GRPO_ROLLOUTS = 24
GRPO_BATCH = 6  # completions per step
GRPO_STEPS = 4
# A learning rate that moves the ratio past the clip range within a batch.
GRPO_LR = 2e-2


def make_rollouts(gen, vocab):
    """Groups of GROUP completions of one prompt, each with a reward in {0, 0.5, 1}."""
    out = []
    for k in range(GRPO_ROLLOUTS // GROUP):
        prompt = torch.randint(0, vocab, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(GROUP):
            completion = torch.randint(0, vocab, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
            reward = 0.5 * int(torch.randint(0, 3, (1,), generator=gen))
            out.append({"prompt_ids": prompt, "completion_ids": completion, "reward": reward, "group": f"g{k}"})
    return out


def advantages(rollouts, scale):
    rewards = torch.tensor([r["reward"] for r in rollouts], dtype=torch.float32)
    grouped = rewards.view(-1, GROUP)
    adv = rewards - grouped.mean(dim=1).repeat_interleave(GROUP)
    if scale == "group":
        adv = adv / (grouped.std(dim=1).repeat_interleave(GROUP) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv


def token_logps(model, rows):
    """Each completion token's log-probability (TRL's selective log-softmax of the shifted
    logits) and the completion mask."""
    per_token, valid = c.token_logps(model, rows)
    return per_token, valid.float()


def grpo_loss(case, logp, old, ref, adv, mask):
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - case["epsilon"], 1 + case["epsilon_high"])
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    kl = None
    if ref is not None:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + case["beta"] * per_token_kl
        kl = ((per_token_kl * mask).sum() / mask.sum()).item()
    if case["loss"] == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif case["loss"] == "dapo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * case["max_len"])
    low = ((coef_1 < 1 - case["epsilon"]) & (a < 0)).float()
    high = ((coef_1 > 1 + case["epsilon_high"]) & (a > 0)).float()
    n = mask.sum()
    return loss, ((low * mask).sum() / n).item(), ((high * mask).sum() / n).item(), kl


def grpo_reference(model, rollouts, case, tr, grads_path):
    rows = [{"input_ids": r["prompt_ids"] + r["completion_ids"],
             "labels": [-100] * len(r["prompt_ids"]) + r["completion_ids"]} for r in rollouts]
    adv = advantages(rollouts, case["scale"])
    # TRL's reference model: the initial one, frozen.
    ref_model = copy.deepcopy(model).eval() if case.get("beta", 0) > 0 else None
    opt = c.adamw(model, tr, GRPO_LR)
    out = {k: [] for k in ("losses", "grad_norms", "clip_ratio/low_mean", "clip_ratio/high_mean")}
    if ref_model is not None:
        out["kl"] = []
    old = None
    for step in range(GRPO_STEPS):
        b = step // case["iterations"]
        sl = slice(b * GRPO_BATCH, (b + 1) * GRPO_BATCH)
        logp, mask = token_logps(model, rows[sl])
        if step % case["iterations"] == 0:
            old = logp.detach()
        ref = None
        if ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logps(ref_model, rows[sl])
        loss, low, high, kl = grpo_loss(case, logp, old, ref, adv[sl], mask)
        loss.backward()
        norm = c.update(model, opt, tr, step, grads_path)
        out["losses"].append(loss.item())
        out["grad_norms"].append(norm.item())
        out["clip_ratio/low_mean"].append(low)
        out["clip_ratio/high_mean"].append(high)
        if kl is not None:
            out["kl"].append(kl)
    return out


def make_case(root, name, case):
    tr = g.TRAIN
    out, expected = c.make_case(
        root, "grpo", name, case, "rollouts.jsonl",
        lambda vocab: make_rollouts(torch.Generator().manual_seed(91), vocab),
        lambda model, rollouts, grads_path: grpo_reference(model, rollouts, case, tr, grads_path))
    c.write_run_yaml(out, "grpo", "path: rollouts.jsonl, shuffle: false", GRPO_BATCH, GRPO_STEPS, GRPO_LR, tr,
                     f"grpo: {{loss_type: {case['loss']}, epsilon: {case['epsilon']}, "
                     f"epsilon_high: {case['epsilon_high']}, num_iterations: {case['iterations']}, "
                     f"scale_rewards: {case['scale']}, max_completion_length: {case['max_len']}, "
                     f"beta: {case.get('beta', 0.0)}}}")
    print(f"grpo/{name}: losses {['%.5f' % l for l in expected['losses']]} "
          f"clip low {expected['clip_ratio/low_mean']} high {expected['clip_ratio/high_mean']} kl {expected.get('kl')}")

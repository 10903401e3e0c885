"""DPO golden cases for scripts/make_golden.py (training.stage: dpo): a tiny model of a
golden family trained a few steps on preference pairs by TRL's DPOTrainer loss formula in
torch (float32), for launcher/tests/dpo.rs.

Per case, under OUT/dpo/<case>/: model/ (save_pretrained), pairs.jsonl (tokenized pairs:
`chosen_input_ids`, `chosen_labels`, `rejected_input_ids`, `rejected_labels`, a shared prompt
masked with -100), run.yaml, expected.json (per step: the mean DPO loss, the pre-clip gradient
norm, and TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected) and
grads0.safetensors (every parameter's gradient at step 1).
"""

import torch
import torch.nn.functional as F

import golden_common as c
import make_golden as g

# DPO: TRL's DPOTrainer loss on pairs of rows (chosen, rejected) sharing a prompt, the
# reference log-probabilities those of the initial weights (one no-grad pass over every row
# before training, as TRL's precompute_ref_log_probs), the loss the mean over the step's pairs.
DPO_CASES = {
    "llama_sigmoid": dict(model_type="llama", config=dict(tie_word_embeddings=False), beta=0.1,
                          loss="sigmoid", smoothing=0.0),
    "qwen3_tied_ipo": dict(model_type="qwen3", config=dict(head_dim=10, tie_word_embeddings=True), beta=0.5,
                           loss="ipo", smoothing=0.0),
    "gemma2_softcap_smoothed": dict(
        model_type="gemma2",
        config=dict(head_dim=10, query_pre_attn_scalar=12, sliding_window=5, initializer_range=0.2,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=0),
        attn="eager", beta=0.3, loss="sigmoid", smoothing=0.2),
}
DPO_PAIRS = 12
DPO_BATCH = 4  # pairs per step


def make_pairs(gen, vocab):
    """Each pair: a prompt (labels -100) and two answers of their own lengths."""
    pairs = []
    for _ in range(DPO_PAIRS):
        prompt = torch.randint(0, vocab, (int(torch.randint(3, 10, (1,), generator=gen)),), generator=gen).tolist()
        rec = {}
        for side in ("chosen", "rejected"):
            answer = torch.randint(0, vocab, (int(torch.randint(2, 11, (1,), generator=gen)),), generator=gen).tolist()
            rec[f"{side}_input_ids"] = prompt + answer
            rec[f"{side}_labels"] = [-100] * len(prompt) + answer
        pairs.append(rec)
    return pairs


def pair_rows(pairs):
    return [{"input_ids": p[f"{s}_input_ids"], "labels": p[f"{s}_labels"]} for p in pairs for s in ("chosen", "rejected")]


def row_logps(model, rows):
    """Each row's summed log-probability of its label tokens (TRL's selective log-softmax of
    the shifted logits, masked, summed) and its label token count."""
    per_token, valid = c.token_logps(model, rows)
    return (per_token * valid).sum(-1), valid.sum(-1)


def dpo_loss(case, logps, ref, n):
    """TRL's per-pair loss (rows alternate chosen, rejected) and rewards."""
    beta, eps = case["beta"], case["smoothing"]
    chosen, rejected = logps[0::2] - ref[0::2], logps[1::2] - ref[1::2]
    if case["loss"] == "ipo":
        delta = chosen / n[0::2].clamp(min=1) - rejected / n[1::2].clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        z = chosen - rejected
        losses = -F.logsigmoid(beta * z) * (1 - eps) - F.logsigmoid(-beta * z) * eps
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()


def dpo_reference(model, pairs, case, tr, grads_path):
    rows = pair_rows(pairs)
    with torch.no_grad():
        ref, _ = row_logps(model, rows)
    opt = c.adamw(model, tr, tr["learning_rate"])
    out = {k: [] for k in ("losses", "grad_norms", "rewards/chosen", "rewards/rejected",
                           "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")}
    for step in range(g.STEPS):
        sl = slice(2 * step * DPO_BATCH, 2 * (step + 1) * DPO_BATCH)
        logps, n = row_logps(model, rows[sl])
        loss, rc, rr = dpo_loss(case, logps, ref[sl], n)
        loss.backward()
        norm = c.update(model, opt, tr, step, grads_path)
        out["losses"].append(loss.item())
        out["grad_norms"].append(norm.item())
        out["rewards/chosen"].append(rc.mean().item())
        out["rewards/rejected"].append(rr.mean().item())
        out["rewards/accuracies"].append((rc > rr).float().mean().item())
        out["rewards/margins"].append((rc - rr).mean().item())
        out["logps/chosen"].append(logps[0::2].mean().item())
        out["logps/rejected"].append(logps[1::2].mean().item())
    return out


def make_case(root, name, case):
    tr = g.TRAIN
    out, expected = c.make_case(
        root, "dpo", name, case, "pairs.jsonl",
        lambda vocab: make_pairs(torch.Generator().manual_seed(77), vocab),
        lambda model, pairs, grads_path: dpo_reference(model, pairs, case, tr, grads_path))
    c.write_run_yaml(out, "dpo", "format: tokenized, path: pairs.jsonl, shuffle: false", DPO_BATCH, g.STEPS,
                     tr["learning_rate"], tr,
                     f"dpo: {{beta: {case['beta']}, loss_type: {case['loss']}, "
                     f"label_smoothing: {case['smoothing']}}}")
    print(f"dpo/{name}: losses {['%.5f' % l for l in expected['losses']]}")

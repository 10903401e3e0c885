"""VERL's training-engine contract (verl.workers.engine.base.BaseEngine) on megatrain.Engine:
a sketch of a VERL backend whose policy trains in `mt-launch serve` (docs/serve.md).

Importable without verl (then BaseEngine is `object` and nothing is registered); with verl
installed, `register()` adds it to VERL's EngineRegistry. Exercised here only through its
own methods on plain dicts of tensors (a TensorDict answers the same `[key]`, `get` and
`keys`); not run inside VERL's trainer on this CPU box.

What maps to what:

- `forward_backward_batch(data, loss_function, forward_only)`: VERL's padded batch
  (`prompts` left-padded with `attention_mask`, `responses` with `response_mask`, a prefix;
  `advantages`, optional `old_log_probs` and `ref_log_prob`, all (B, R)) becomes the
  engine's GRPO rollouts (prompt ids, completion ids, the sequence's advantage, per-token
  old and reference log-probabilities); forward only, `forward` of the same rows, each
  row's log-probabilities padded back to (B, R) as `model_output["log_probs"]`. The loss
  is the engine's, from its config (`training.stage: grpo`, `grpo.*`): `loss_function` is
  not called, so the config must say what VERL's actor config says (clip ratios, loss
  aggregation);
- `optimizer_zero_grad`: nothing (the engine's first `train_step` after an update
  overwrites the gradient); `optimizer_step`: the update, returning the gradient norm;
  `lr_scheduler_step`: the engine's schedule follows its own step, so this reads it;
- `get_per_tensor_param()`: (the store's (HF name, tensor) views, zero-copy, no PEFT
  config), what VERL hands its rollout engine's `load_weights`;
- `to("cpu")` / `to("cuda")`: `sleep` / `wake` (every GPU buffer released and taken back,
  for a rollout engine colocated on the same GPUs; the state never leaves host RAM);
- `save_checkpoint(path)`: a full checkpoint in the engine's `checkpoint.dir`, `path` a link
  to it; `load_checkpoint(path)`: the server started again resuming from it (`mt-launch
  serve ... --resume PATH`);
- data parallelism: one VERL process drives the engine, whose workers are its own, so the
  data-parallel size VERL sees is 1.
"""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import megatrain  # noqa: E402

try:
    from verl.workers.engine.base import BaseEngine, EngineRegistry
except ImportError:  # verl not installed: the adapter stands alone
    BaseEngine, EngineRegistry = object, None


class MegatrainEngine(BaseEngine):
    """A VERL engine whose model, optimizer and gradients live in `mt-launch serve`."""

    def __init__(self, config, *, gpus=1, workers=None, overrides=None, engine=None, **start):
        self.config, self.start = config, dict(gpus=gpus, workers=workers, overrides=overrides, **start)
        self.engine = engine if engine is not None else megatrain.Engine(config, **self.start)
        self.asleep = False
        self.mode = None

    def initialize(self):
        """The server is up once the constructor returns."""

    @property
    def is_param_offload_enabled(self):
        return True  # the weights live in host RAM; GPUs stream them

    @property
    def is_optimizer_offload_enabled(self):
        return True

    def train_mode(self, **kwargs):
        return self._mode("train")

    def eval_mode(self, **kwargs):
        return self._mode("eval")

    @contextlib.contextmanager
    def _mode(self, mode):
        self.to("cuda")
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None

    def optimizer_zero_grad(self):
        """Nothing to do: the first train_step after an update overwrites the gradient."""

    def forward_backward_batch(self, data, loss_function=None, forward_only=False):
        rollouts = to_rollouts(data)
        if forward_only:
            rows = [{"input_ids": r["prompt_ids"] + r["completion_ids"],
                     "labels": [-100] * len(r["prompt_ids"]) + r["completion_ids"]} for r in rollouts]
            out = self.engine.forward(rows, as_torch=True)
            model_output = {"log_probs": pad_like(out["logprobs"], data["responses"])}
            if "entropy" in out:
                model_output["entropy"] = pad_like(out["entropy"], data["responses"])
            return {"model_output": model_output, "loss": [], "metrics": {}}
        out = self.engine.train_step(rollouts=rollouts)
        return {"model_output": {}, "loss": [out["loss"]], "metrics": out["metrics"]}

    def train_batch(self, data, loss_function=None):
        outputs = self.forward_backward_batch(data, loss_function)
        outputs["metrics"]["grad_norm"] = self.optimizer_step()
        return outputs

    def infer_batch(self, data, loss_function=None):
        return self.forward_backward_batch(data, loss_function, forward_only=True)

    def optimizer_step(self):
        return self.engine.optimizer_step()["grad_norm"]

    def lr_scheduler_step(self):
        return self.engine.info()["lr"]

    def get_per_tensor_param(self, **kwargs):
        return self.engine.state_dict_views(), None

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True

    def to(self, device, model=True, optimizer=True, grad=True):
        want_asleep = str(device) == "cpu"
        if want_asleep and not self.asleep:
            self.engine.sleep()
        elif self.asleep and not want_asleep:
            self.engine.wake()
        self.asleep = want_asleep

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """A checkpoint under the engine's checkpoint.dir (which also keeps the number the
        config says), linked from `local_path` so that load_checkpoint(local_path) finds it."""
        saved = self.engine.save()
        parent = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(local_path):
            os.remove(local_path)
        os.symlink(saved, local_path)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        self.engine.shutdown()
        start = dict(self.start, args=list(self.start.get("args", ())) + ["--resume", os.path.abspath(local_path)])
        self.engine = megatrain.Engine(self.config, **start)
        self.asleep = False


def to_rollouts(data):
    """VERL's padded batch as the engine's rollouts (docs/serve.md, "Batches")."""
    prompts, responses = data["prompts"], data["responses"]
    p_len = prompts.shape[1]
    prompt_mask = data["attention_mask"][:, :p_len].bool()
    response_mask = data["response_mask"].bool()
    old, ref = _get(data, "old_log_probs"), _get(data, "ref_log_prob")
    out = []
    for i in range(prompts.shape[0]):
        n = int(response_mask[i].sum())
        if not bool(response_mask[i, :n].all()):
            raise ValueError(f"row {i}: response_mask is not a prefix (multi-turn masks are not supported)")
        r = {"prompt_ids": prompts[i][prompt_mask[i]].tolist(), "completion_ids": responses[i, :n].tolist(),
             "advantage": float(data["advantages"][i, 0])}  # GRPO's: one value per sequence
        if old is not None:
            r["old_logps"] = old[i, :n].float().tolist()
        if ref is not None:
            r["ref_logps"] = ref[i, :n].float().tolist()
        out.append(r)
    return out


def pad_like(rows, like):
    """Per-row 1-D tensors as one (B, R) float32 tensor shaped like `like`, zero-padded."""
    out = torch.zeros(like.shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _get(data, key):
    return data[key] if key in data.keys() else None


def register(model_type="language_model", backend="megatrain"):
    """Adds MegatrainEngine to VERL's EngineRegistry (verl installed)."""
    if EngineRegistry is None:
        raise ImportError("verl is not installed")
    return EngineRegistry.register(model_type=model_type, backend=backend)(MegatrainEngine)

"""The W&B / MLflow side process of megatrain-rs (`logging.report_to: wandb, mlflow`).

mt-launch (launcher/src/trackers.rs, which embeds this file, so an installed binary needs no
checkout) runs it with the interpreter `logging.python` names, `python -c <this> <pid>`, and
writes JSON lines to its stdin:

    {"start": {"trackers": [...], "run_name": str, "config": {...}, "plan": {...}}}  first
    {"step": int, "metrics": {tag: number or null}}                                per step
    {"summary": {name: number}}                                                    at the end
    {"end": "finished" | "killed"}                                                 last

It answers once on stdout, after starting its runs: {"ready": {tracker: where}} or
{"error": message}; whatever else is printed (the libraries' messages) goes to stderr.
A tracker whose call fails later is warned of once and left out; the others go on, and so
does training. End of input without "end" (the launcher failed or died) finishes the runs
as failed. It dies with the launcher (PR_SET_PDEATHSIG, then SIGTERM finishes the runs) and
ignores SIGINT: Ctrl-C reaches the launcher, which ends the run and closes the stream.
"""

import ctypes
import json
import os
import signal
import sys

# mlflow's limit on a parameter's value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
MAX_PARAM_LEN = 6000


def warn(msg):
    print(f"mt-launch report_to: {msg}", file=sys.stderr, flush=True)


def die_with_launcher(launcher_pid):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: end of input still ends it
    if os.getppid() != launcher_pid:
        sys.exit(1)  # the launcher died before prctl


def flatten(d, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": "1"}: MLflow parameters are flat strings."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif v is not None:
            s = json.dumps(v) if isinstance(v, list) else str(v)
            out[key] = s[:MAX_PARAM_LEN]
    return out


class Wandb:
    name = "wandb"

    def start(self, s):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "megatrain"),
            name=s["run_name"],
            config={**s["config"], "plan": s["plan"]},
        )
        return self.run.url or os.path.dirname(self.run.dir)

    def step(self, step, metrics):
        self.run.log(metrics, step=step)

    def summary(self, values):
        self.run.summary.update(values)

    def end(self, status):
        self.run.finish(exit_code=0 if status == "finished" else 1)


class Mlflow:
    name = "mlflow"

    def start(self, s):
        import mlflow

        self.mlflow = mlflow
        env = os.environ
        if not env.get("MLFLOW_EXPERIMENT_NAME") and not env.get("MLFLOW_EXPERIMENT_ID"):
            mlflow.set_experiment("megatrain")
        run = mlflow.start_run(run_name=s["run_name"])
        mlflow.log_params({**flatten(s["config"]), **flatten(s["plan"], "plan.")})
        mlflow.set_tags({"mt.world_size": s["plan"].get("world_size"), "mt.source": "megatrain-rs"})
        return f"{mlflow.get_tracking_uri()} run {run.info.run_id}"

    def step(self, step, metrics):
        self.mlflow.log_metrics(metrics, step=step)

    def summary(self, values):
        self.mlflow.log_metrics(values)

    def end(self, status):
        self.mlflow.end_run({"finished": "FINISHED", "killed": "KILLED"}.get(status, "FAILED"))


def main():
    die_with_launcher(int(sys.argv[1]))
    # The answer goes to the real stdout; the libraries' prints to stderr.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        answer.write(json.dumps(obj) + "\n")
        answer.flush()

    live = []

    def each(what, call):
        for t in list(live):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 -- any failure of a tracker's client
                live.remove(t)
                warn(f"{t.name} failed in {what} ({type(e).__name__}: {e}); it is left out from here on, training goes on")

    status = "failed"
    try:
        first = sys.stdin.readline()
        if not first:
            return
        start = json.loads(first)["start"]
        where = {}
        for t in [{"wandb": Wandb, "mlflow": Mlflow}[n]() for n in start["trackers"]]:
            try:
                where[t.name] = t.start(start)
                live.append(t)
            except Exception as e:  # noqa: BLE001
                reply({"error": f"{t.name} could not start a run ({type(e).__name__}: {e})"})
                for t in live:
                    t.end("failed")
                return
        reply({"ready": where})
        for line in sys.stdin:
            msg = json.loads(line)
            if "step" in msg:
                m = {k: v for k, v in msg["metrics"].items() if v is not None}
                each("logging step " + str(msg["step"]), lambda t: t.step(msg["step"], m))
            elif "summary" in msg:
                each("the summary", lambda t: t.summary(msg["summary"]))
            elif "end" in msg:
                status = msg["end"]
    finally:
        # Finishing already: the launcher's death (end of input, then SIGTERM) ends the
        # runs once, as failed.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        each("finishing the run", lambda t: t.end(status))


if __name__ == "__main__":
    main()

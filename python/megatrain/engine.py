"""`megatrain.Engine`: a persistent `mt-launch serve` driven from Python (docs/serve.md).

    with megatrain.Engine("configs/tiny_grpo.yaml", gpus=0, workers=1) as engine:
        engine.train_step(rollouts=[...])
        engine.optimizer_step()
        engine.copy_weights_to(hf_model)        # the store's weights, no disk

One method per command of the protocol, each a request and its answer on one connection;
an answer `{"ok": false, "error": ...}` raises `EngineError(error)` and leaves the server
as it was, unless the answer says `fatal` (a worker lost: the server ends, as a run would;
the error says so, with the server's exit status and last lines when this Engine started
it). Calls are serialized (a lock), so threads may share an Engine.

Ownership: an Engine built with `Engine(config, ...)` started its server and owns it:
`shutdown()`, `close()`, leaving a `with` block, garbage collection and interpreter exit
all stop it (server.py: SIGTERM to its process group, then SIGKILL), so it never outlives
the Engine. `Engine.attach(path)` talks to a server someone else started: `close()` and
leaving a `with` block only disconnect (the server serves the next client), `shutdown()`
stops it.

A request interrupted half-way (Ctrl-C while waiting for an answer) drops the connection,
whose next answer would be the interrupted one's; the next call connects again, after the
server finished the interrupted command.
"""

import os
import socket as _socket
import threading
import weakref

from . import convert, server, wire
from .views import Weights
from .wire import EngineError


class _Resources:
    """What an Engine must release, reachable from its finalizer without the Engine."""

    def __init__(self):
        self.sock = None
        self.server = None

    def disconnect(self):
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def release(self):
        self.disconnect()
        if self.server is not None:
            self.server.stop()


class Engine:
    """A training engine in an `mt-launch serve` process. See the module's doc."""

    def __init__(self, config, *, gpus=0, workers=None, overrides=None, socket=None, launcher=None,
                 env=None, startup_timeout=600, log=None, args=()):
        """Starts `mt-launch serve --config config` and connects to it.

        gpus: `--gpus` (0: CPU workers); workers: `--workers` (None: the launcher's default);
        overrides: {key: value} as `--set key=value` (non-strings written as JSON);
        socket: the socket's path (default: in a private temporary directory);
        launcher: the mt-launch binary (default: $MT_LAUNCH, the repository's
        target/release/mt-launch, or PATH); env: variables added to the server's
        environment; startup_timeout: seconds to wait for `serving on`; log: a file the
        server's output is appended to (default: this process's stdout and stderr);
        args: more arguments for `mt-launch serve`.
        """
        self._init()
        self._res.server = server.start(config, gpus=gpus, workers=workers, overrides=overrides,
                                        socket_path=socket, launcher=launcher, env=env, log=log,
                                        timeout=startup_timeout, extra=args)
        self._path = self._res.server.socket_path
        try:
            self._connect()
        except BaseException:
            self._res.release()
            raise

    @classmethod
    def attach(cls, socket_path):
        """An Engine on a server already serving at `socket_path` (not owned: see the
        module's doc)."""
        self = cls.__new__(cls)
        self._init()
        self._path = os.fspath(socket_path)
        self._connect()
        return self

    def _init(self):
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self._lock = threading.RLock()
        self._path = None
        self._weights = None

    def _connect(self):
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.connect(self._path)
        except OSError as e:
            s.close()
            raise EngineError(f"cannot connect to {self._path}: {e}{self._exit_note()}") from None
        self._res.sock = s

    # -- the commands ------------------------------------------------------------------

    def info(self):
        """protocol, stage, step, version, lr, pending, params, workers, model_type, dtype,
        max_seq_len."""
        return self._call("info")

    def train_step(self, *, rows=None, pairs=None, rollouts=None, loss_units=None):
        """Adds one batch's gradient (rows for pt/sft, pairs for dpo, rollouts for grpo, as
        `training.stage` says; rows may be bare token-id sequences, as in `forward`);
        returns loss, units, tokens and the objective's metrics. `loss_units`: what the
        loss is a mean over when one batch is split over several calls (the whole batch's
        count; docs/serve.md, "Steps")."""
        given = {k: v for k, v in (("rows", rows), ("pairs", pairs), ("rollouts", rollouts)) if v is not None}
        if len(given) != 1:
            raise EngineError(f"train_step takes one of rows=, pairs=, rollouts= (got {sorted(given) or 'none'})")
        (key, batch), = given.items()
        req = {key: convert.rows_of(batch) if key == "rows" else convert.plain(batch)}
        if loss_units is not None:
            req["loss_units"] = int(loss_units)
        return self._call("train_step", **req)

    def forward(self, rows, *, entropy=False, sum=False, as_torch=False):
        """Forward only, no update: the answer with each per-row list (`logprobs`, and with
        `entropy` each label token's entropy) as 1-D float32 arrays (see
        `forward_logprobs`); with `sum`, `logprobs` is each row's sum, a float (DPO's
        reference, as a DPO run computes it)."""
        flags = {k: True for k, on in (("entropy", entropy), ("sum", sum)) if on}
        answer = self._call("forward", rows=convert.rows_of(rows), **flags)
        for k, v in answer.items():
            if isinstance(v, list) and all(isinstance(r, list) for r in v):
                answer[k] = convert.float_rows(v, as_torch)
        return answer

    def forward_logprobs(self, rows, *, as_torch=False):
        """Each row's label tokens' log-probabilities under the current weights, as a list
        of 1-D float32 numpy arrays (torch tensors with `as_torch`). `rows`: dicts with
        `input_ids` and optional `labels` (-100: no label), or bare token-id sequences."""
        return self.forward(rows, as_torch=as_torch)["logprobs"]

    def optimizer_step(self, lr=None):
        """Clips the accumulated gradient and applies one AdamW update (at `lr` when given);
        returns step, grad_norm, lr, skipped."""
        return self._call("optimizer_step", **({} if lr is None else {"lr": float(lr)}))

    def set_lr(self, lr):
        """The learning rate of the next updates (None: back to the schedule); returns it."""
        return self._call("set_lr", lr=None if lr is None else float(lr))["lr"]

    def save(self):
        """A full checkpoint of the updates applied, `checkpoint.dir/step-N` (resumable by a
        run, or by a server started with `args=["--resume", dir]`); returns its path."""
        return self._call("save")["dir"]

    def export(self, dir):
        """An HF model directory of the current weights, written atomically; returns it."""
        return self._call("export", dir=os.path.abspath(dir))["dir"]

    def sleep(self):
        """Stops the workers, releasing every GPU buffer (the host state stays)."""
        return self._call("sleep")

    def wake(self):
        """Starts the workers again on the host state."""
        return self._call("wake")

    # -- weights without a copy ---------------------------------------------------------

    def weights(self):
        """The store mapped read-only (views.Weights), asked for once per Engine."""
        with self._lock:
            if self._weights is None:
                answer, fds = self._request("weights")
                self._weights = Weights(answer, fds)
            return self._weights

    def state_dict_views(self):
        """Yields (HF name, tensor) for each tensor of the store, zero-copy and read-only
        (views.py). Tensors not trained (buffers, a vision tower) are not among them."""
        return self.weights().tensors()

    def weights_version(self):
        """The store's seqlock: 2 x updates applied, odd while an update writes."""
        return self.weights().version()

    def views_consistent(self, version):
        """Whether views read after `weights_version()` returned `version` are that update
        whole (even, and unchanged since): read again if not."""
        return self.weights().consistent(version)

    def copy_weights_to(self, target, timeout=60.0):
        """Copies the store into `target` (a torch module or a dict of tensors, by HF name)
        under the seqlock; returns the version copied."""
        params = target.state_dict() if hasattr(target, "state_dict") else target
        return self.weights().copy_into(params, timeout=timeout)

    # -- the end ------------------------------------------------------------------------

    def shutdown(self, timeout=server.GRACE_S):
        """Stops the server (the `shutdown` command; a server this Engine started is then
        waited for, and killed after `timeout` s). Idempotent."""
        with self._lock:
            if not self._finalizer.alive:
                return
            srv = self._res.server
            try:
                if self._res.sock is not None or srv is None:
                    self._request("shutdown")
            except EngineError:
                if srv is None:
                    raise
            finally:
                self._res.disconnect()
                if srv is not None:
                    srv.wait(timeout)
                    srv.stop(grace=timeout)
                self._finalizer.detach()

    def close(self):
        """An owned server: `shutdown()`. An attached one: disconnect only."""
        if self._res.server is not None:
            self.shutdown()
        else:
            with self._lock:
                self._res.disconnect()
            self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def socket_path(self):
        return self._path

    @property
    def pid(self):
        """The server's pid when this Engine started it, else None."""
        return self._res.server.proc.pid if self._res.server is not None else None

    def __repr__(self):
        return f"<megatrain.Engine {self._path} pid={self.pid}>"

    # -- one request --------------------------------------------------------------------

    def _call(self, cmd, **keys):
        answer, fds = self._request(cmd, **keys)
        wire.close_fds(fds)
        answer.pop("ok", None)
        return answer

    def _request(self, cmd, **keys):
        """Sends one request, returns (answer, fds) of an ok answer; raises EngineError."""
        with self._lock:
            if not self._finalizer.alive:
                raise EngineError(f"{cmd}: the engine is shut down")
            if self._res.sock is None:
                self._connect()
            frame = wire.encode({"cmd": cmd, **keys})  # a NaN is refused here, nothing sent
            try:
                self._res.sock.sendall(frame)
                answer, fds = wire.recv_msg(self._res.sock)
            except (OSError, wire.WireError) as e:
                self._res.disconnect()
                raise EngineError(f"{cmd}: {e}{self._exit_note()}") from None
            except BaseException:  # interrupted: the answer would come to the next request
                self._res.disconnect()
                raise
        if answer.get("ok") is not True:
            wire.close_fds(fds)
            error = str(answer.get("error") or f"{cmd} failed without saying why: {answer}")
            if answer.get("fatal"):  # the server ends after this answer, as a run would
                with self._lock:
                    self._res.disconnect()
                raise EngineError(f"{error} (fatal: the server stopped){self._exit_note()}")
            raise EngineError(error)
        return answer, fds

    def _exit_note(self):
        """How the owned server ended, with its last lines, when it has."""
        srv = self._res.server
        if srv is None:
            return ""
        try:
            srv.proc.wait(timeout=5)
        except Exception:
            return ""
        return f" (mt-launch serve exited with status {srv.proc.returncode}):\n{srv.last_lines()}"

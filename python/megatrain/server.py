"""Starting `mt-launch serve` for an Engine, and making sure it never outlives it.

`start` runs `mt-launch serve --config X --socket S ...` with S in a fresh private
directory (mkdtemp, 0700), in a session of its own (its process group is its pid), with
stdout and stderr piped through two threads that copy each line to the caller's
`sys.stdout` / `sys.stderr` (or to a log file) and keep the last lines. It returns once
the server prints `serving on PATH`; a server that exits first, or stays silent past the
timeout, raises `EngineError` with its last lines (the timeout kills it first).

`Server.stop` is the one way out, also as the Engine's finalizer (garbage collection and
interpreter exit, `weakref.finalize`): SIGTERM to the process group (the server stops its
workers as a run does), a grace period, then SIGKILL to the group. The group is signalled
only while the server is unreaped, so its pid cannot have been reused. Started from the
main thread, the server also gets `PR_SET_PDEATHSIG` (SIGTERM), so a client killed with
SIGKILL takes it down too (from another thread it is not set: the signal would follow that
thread's exit, not the process's).

The launcher: the `launcher` argument, else `$MT_LAUNCH`, else the repository's
`target/release/mt-launch` beside this package (a source checkout), else `mt-launch` on
PATH (the megatrain-rs wheel puts it there).
"""

import collections
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .wire import EngineError

SERVING = "serving on "
GRACE_S = 30.0
_TAIL = 40


def find_launcher(launcher=None):
    """The mt-launch binary to run (see the module's doc), or EngineError naming the places
    looked in."""
    if launcher:
        return str(launcher)
    if os.environ.get("MT_LAUNCH"):
        return os.environ["MT_LAUNCH"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    built = os.path.join(repo, "target", "release", "mt-launch")
    if os.access(built, os.X_OK):
        return built
    found = shutil.which("mt-launch")
    if found:
        return found
    raise EngineError(f"no mt-launch: not in $MT_LAUNCH, not built at {built} (cargo build --release "
                      "--workspace), not on PATH (pip install the megatrain-rs wheel); or pass launcher=")


def override_args(overrides):
    """`--set key=value` for each item; values that are not strings as JSON (which YAML
    reads back as the same value)."""
    import json

    args = []
    for k, v in (overrides or {}).items():
        args += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return args


class Server:
    """A started `mt-launch serve` process: its socket path, its output's last lines, and
    `stop()`."""

    def __init__(self, proc, tmpdir, tail, pumps):
        self.proc = proc
        self.tmpdir = tmpdir
        self.tail = tail
        self.pumps = pumps
        self.socket_path = None

    def last_lines(self):
        for t in self.pumps:
            t.join(timeout=2.0)
        return "\n".join(self.tail)

    def wait(self, timeout):
        """Waits up to `timeout` s for the server to exit by itself."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace=GRACE_S):
        """SIGTERM to the group, then SIGKILL after `grace` seconds; removes the private
        directory. Idempotent; never raises."""
        try:
            if self.proc.poll() is None:
                _signal_group(self.proc, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    _signal_group(self.proc, signal.SIGKILL)
                    self.proc.wait()
        except Exception:  # a finalizer at interpreter exit: nothing to report to
            pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def start(config, *, gpus, workers, overrides, socket_path, launcher, env, log, timeout, extra=()):
    """Runs the server and waits for its `serving on` line; returns the Server."""
    tmpdir = tempfile.mkdtemp(prefix="megatrain-")  # mode 0700
    sock = socket_path or os.path.join(tmpdir, "engine.sock")
    cmd = [find_launcher(launcher), "serve", "--config", os.fspath(config), "--socket", os.fspath(sock),
           "--gpus", str(gpus)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    cmd += override_args(overrides) + list(extra)
    full_env = dict(os.environ)
    full_env.update(env or {})
    main_thread = threading.current_thread() is threading.main_thread()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=full_env, start_new_session=True,
                                preexec_fn=_die_with_parent if main_thread and _prctl else None)
    except OSError as e:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise EngineError(f"cannot run {cmd[0]}: {e}") from None
    tail = collections.deque(maxlen=_TAIL)
    ready = threading.Event()
    found = []

    def on_stdout(line):
        if not ready.is_set() and line.startswith(SERVING):
            found.append(line[len(SERVING):].strip())
            ready.set()

    pumps = [threading.Thread(target=_pump, args=(proc.stdout, log, "stdout", tail, on_stdout), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, log, "stderr", tail, None), daemon=True)]
    for t in pumps:
        t.start()
    server = Server(proc, tmpdir, tail, pumps)
    deadline = time.monotonic() + timeout
    while not ready.wait(0.05):
        if proc.poll() is not None:
            lines = server.last_lines()
            server.stop()
            raise EngineError(f"mt-launch serve exited with status {proc.returncode} during start-up "
                              f"({' '.join(cmd)}):\n{lines}")
        if time.monotonic() > deadline:
            server.stop()
            raise EngineError(f"mt-launch serve did not print `serving on` within {timeout} s "
                              f"({' '.join(cmd)}):\n{server.last_lines()}")
    server.socket_path = found[0]
    return server


def _pump(stream, log, std, tail, on_line):
    """Copies the server's lines to `log` (a file, appended to) or to this process's
    `sys.<std>` (looked up per line, so a notebook's replaced sys.stdout gets them),
    keeping the last ones; ends at EOF."""
    sink = open(log, "a", buffering=1) if log is not None else None
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            if on_line:
                on_line(line)
            try:
                out = sink or getattr(sys, std)
                out.write(line + "\n")
                out.flush()
            except Exception:  # a closed sys.stdout at interpreter exit
                pass
    finally:
        stream.close()
        if sink is not None:
            sink.close()


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


try:  # looked up here, not in the child: dlopen between fork and exec can deadlock
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent():
    """In the child before exec: SIGTERM when the parent dies (PR_SET_PDEATHSIG = 1)."""
    if _prctl is not None:
        _prctl(1, int(signal.SIGTERM), 0, 0, 0)

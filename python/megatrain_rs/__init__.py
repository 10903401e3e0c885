"""megatrain-rs as a wheel: `mt-launch` and `mt-worker` run with the torch of this Python.

The wheel (scripts/build_wheel.sh) holds the two binaries in bin/ beside this file; its
console scripts `mt-launch` and `mt-worker` call `launch` and `worker`, which exec the
binary with torch's lib folder first on LD_LIBRARY_PATH (found without importing torch,
which takes seconds), so the binary and the workers it spawns load that libtorch. A
`MT_LIBTORCH` already set is left to the launcher (launcher/src/torch.rs) instead.
"""

import importlib.util
import os
import sys

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")
TORCH = "torch==2.11.0"


def torch_lib():
    """torch's lib folder for this Python, or exit saying how to install it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"megatrain-rs: no torch for {sys.executable}: "
            f"{sys.executable} -m pip install {TORCH}"
        )
    return os.path.join(spec.submodule_search_locations[0], "lib")


def _exec(name):
    env = dict(os.environ)
    if "MT_LIBTORCH" not in env:
        rest = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([torch_lib()] + rest)
    env.setdefault("MT_PYTHON", sys.executable)
    path = os.path.join(BIN, name)
    os.execve(path, [name] + sys.argv[1:], env)


def launch():
    _exec("mt-launch")


def worker():
    _exec("mt-worker")

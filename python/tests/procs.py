"""What the client's tests ask of processes (test_engine.py, serve_e2e.py)."""


def alive(pid):
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

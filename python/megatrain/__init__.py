"""megatrain: the Python client of megatrain-rs's persistent engine (`mt-launch serve`).

    import megatrain
    with megatrain.Engine("configs/tiny_grpo.yaml", gpus=0, workers=1) as engine:
        engine.train_step(rollouts=rollouts)
        engine.optimizer_step()
        engine.copy_weights_to(model)

Pure Python (the standard library; numpy and torch used when installed, for tensors in
and out). The protocol is docs/serve.md; `Engine` is engine.py, the frames wire.py, the
zero-copy weights views.py, starting and stopping the server server.py.
"""

from .engine import Engine
from .views import Weights
from .wire import EngineError

__all__ = ["Engine", "EngineError", "Weights"]
__version__ = "0.1.0"

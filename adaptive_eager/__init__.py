"""adaptive_eager: defer eager PyTorch ops into traces and replay them, keeping eager semantics.

    import adaptive_eager
    with adaptive_eager.adaptive_eager():
        train_step()
"""

import sys as _sys

from adaptive_eager.api import (
    EngineContext, adaptive_eager, clear_caches, disable, enable, is_enabled, metrics,
    reset_metrics, sync, wait_for_compiles,
)
from adaptive_eager.config import ConfigError
from adaptive_eager.dispatch.lazy import LazyTensor, ValueUnavailable
from adaptive_eager.dispatch.regions import install as _install_region_hooks

# torch.compile'd functions made from here on run as compiled code inside an engine's context
# (Note [compiled regions]); only torch.compile itself is wrapped now, torch._dynamo stays unloaded.
_install_region_hooks()

__version__ = "0.1.0"

# ADAPTIVE_EAGER=1 seen while this package was being imported (Note [autoload during the
# package's import] in adaptive_eager_autoload.py): switch on now that it can
if getattr(_sys.modules.get("adaptive_eager_autoload"), "deferred", False):
    _sys.modules["adaptive_eager_autoload"].run_deferred()

__all__ = [
    "ConfigError", "EngineContext", "LazyTensor", "ValueUnavailable", "adaptive_eager",
    "clear_caches", "disable", "enable", "is_enabled", "metrics", "reset_metrics", "sync",
    "wait_for_compiles",
    "__version__",
]

"""TorchNeuron-style spelling.

    from adaptive_eager import neuron
    with neuron.adaptive_eager():
        ...
"""

from adaptive_eager.api import adaptive_eager, disable, enable, sync

__all__ = ["adaptive_eager", "disable", "enable", "sync"]

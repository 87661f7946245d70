"""The ``inductor`` backend: a trace graph compiled by ``torch._inductor.standalone_compile``.

Fused C++ kernels on CPU, Triton on CUDA. Programs are specialized to the example inputs' shapes
(the trace key already fixes every shape). ``standalone_compile`` artifacts serialize to a few
hundred kB and load in milliseconds, so a warm process runs fused programs without compiling.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

_FORMAT = "binary"


class InductorBackend:
    name = "inductor"
    compiles = True

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def options_key(self) -> str:
        return f"inductor:{sorted(self.options.items())}"

    def compile(self, graph: Any) -> Any:
        with torch.no_grad():
            return torch._inductor.standalone_compile(
                graph.gm, _detached(graph.example_inputs), dynamic_shapes="from_example_inputs",
                options=self.options)

    def serialize(self, program: Any) -> bytes:
        with tempfile.TemporaryDirectory(prefix="adaptive_eager-") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            program.save(path=path, format=_FORMAT)
            with open(path, "rb") as f:
                return f.read()

    def load(self, data: bytes, graph: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="adaptive_eager-") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            with open(path, "wb") as f:
                f.write(data)
            return torch._inductor.CompiledArtifact.load(path=path, format=_FORMAT)


def _detached(inputs: list[Any]) -> list[Any]:
    """Compile for inference: the engine runs programs below autograd, on detached aliases."""
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]

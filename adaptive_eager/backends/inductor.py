"""The ``inductor`` backend: a trace graph compiled by ``torch._inductor.standalone_compile``.

Fused C++ kernels on CPU, Triton on CUDA. Programs are specialized to the example inputs' shapes
(the trace key already fixes every shape). Compiled with ``aot=True``, an artifact serializes to
bytes in memory (15-40 kB for small graphs) and deserializes in milliseconds. On CPU the artifact
holds C++ source: the compiled kernels live in Inductor's cache folder, which the engine points
into its own cache folder (unless TORCHINDUCTOR_CACHE_DIR is set), so a warm process also finds
the kernels and runs no compiler. Artifacts are specific to one torch build: the build's key is
stored with each and checked on load.
"""

from __future__ import annotations

import os
from typing import Any

import torch

class InductorBackend:
    name = "inductor"
    compiles = True
    separate_process = True  # compiles in the helper process (Note [compile process])

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def options_key(self) -> str:
        return f"inductor:{sorted(self.options.items())}"

    def compile(self, graph: Any) -> Any:
        with torch.no_grad():  # an inference program: autograd already ran above the engine
            return torch._inductor.standalone_compile(
                graph.gm, _detached(graph.example_inputs), dynamic_shapes="from_example_inputs",
                options=self.options, aot=True)

    def serialize(self, program: Any) -> bytes:
        return _build_key() + program.serialize()

    def load(self, data: bytes, graph: Any) -> Any:
        from torch._inductor.standalone_compile import AOTCompiledArtifact

        key = _build_key()
        if not data.startswith(key):
            raise ValueError("artifact was compiled by another torch build")
        return AOTCompiledArtifact.deserialize(data[len(key):])


def _build_key() -> bytes:
    """A fixed-length prefix naming the torch build (a hash of its sources)."""
    from torch._inductor.codecache import torch_key

    return b"AE1" + torch_key()[:32].ljust(32, b"\0")


    def warm_up(self) -> None:
        """Import what loading a program needs (seconds in a fresh interpreter)."""
        from torch._inductor import compile_fx, standalone_compile  # noqa: F401

    def prepare(self, cache_dir: str) -> None:
        """Keep Inductor's compiled kernels next to the programs, unless the user chose a
        folder (TORCHINDUCTOR_CACHE_DIR), so a warm process finds them and runs no compiler."""
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")


def _detached(inputs: list[Any]) -> list[Any]:
    """Compile for inference: the engine runs programs below autograd, on detached aliases."""
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]

"""Run the same function in plain eager and under the engine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import adaptive_eager as ae


def eager_and_engine(fn: Callable[[], Any], **options: Any) -> tuple[Any, Any]:
    """Call ``fn`` twice: once in plain eager, once under the engine (after a reseed each time).

    The engine runs op by op (backend "replay") unless ``options`` say otherwise: these are the
    bitwise comparisons; fused programs are compared within tolerances in test_compile.py.
    """
    options.setdefault("backend", "replay")
    torch.manual_seed(1234)
    expected = fn()
    torch.manual_seed(1234)
    with ae.adaptive_eager(check=True, **options):
        got = fn()
    return expected, got


def to_plain(x: Any) -> Any:
    """Detach tensors (materializing lazy ones) so results can be compared after the context."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(to_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    return x


def assert_equal_tree(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_tree(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal_tree(a[k], b[k])
    else:
        assert a == b, (a, b)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, steps: int, options: dict[str, Any] | None = None,
                each_step: Callable[[], Any] | None = None,
                before_step: Callable[[], Any] | None = None) -> list[float]:
    """An ordinary MSE training loop, under the engine when ``options`` is given (even empty);
    ``before_step`` runs before each optimizer step (the end of a round), ``each_step`` after."""
    losses = []
    ctx = ae.adaptive_eager(**options) if options is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if before_step is not None:
                before_step()
            opt.step()
            losses.append(loss.item())
            if each_step is not None:
                each_step()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses


@contextlib.contextmanager
def registered(backend: Any) -> Iterator[Any]:
    """``backend`` found by its name while the block runs (as an entry point would be)."""
    from adaptive_eager import backends

    backends._instances[backend.name] = backend
    try:
        yield backend
    finally:
        backends._instances.pop(backend.name, None)


class GraphProgramBackend:
    """A compiling backend whose programs are the trace graphs themselves (eager's own aten
    kernels, no Inductor): a compile costs nothing and results stay bitwise eager's, so the
    mechanics around programs (trials, decisions) run in quick tests."""

    name = "test-fxgraph"
    compiles = True

    def options_key(self) -> str:
        return "test-fxgraph:1"

    def compile(self, graph: Any) -> Any:
        return graph.gm

    def serialize(self, program: Any) -> bytes:
        raise RuntimeError("not stored")  # kept in memory only

    def load(self, data: bytes, graph: Any) -> Any:
        raise RuntimeError("never stored")


def refcounts_around(watched: tuple, run: Callable[[], Any], times: int = 20
                     ) -> tuple[list, list]:
    """Reference counts of ``watched`` before and after ``times`` runs of ``run`` (each synced):
    equal when the engine's paths neither leak nor steal references."""
    import gc
    import sys

    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(times):
        run()
        ae.sync()
    gc.collect()
    return before, [sys.getrefcount(o) for o in watched]


def global_state() -> dict[str, Any]:
    """What a program may rely on staying as it was: the thread's dispatch key sets, both mode
    stacks, grad/inference/forward-AD modes, autocast, backend and numeric flags, the default
    generator, the Python profile and trace functions, torch.Tensor's methods and the global
    module hooks (compare the state after a run under the engine with the state after the same
    run in plain eager)."""
    import sys

    from torch.nn.modules import module as nn_module

    c = torch._C
    flags: dict[str, Any] = {}
    for name, get in (("cudnn", lambda: (torch.backends.cudnn.enabled,
                                         torch.backends.cudnn.benchmark,
                                         torch.backends.cudnn.deterministic)),
                      ("tf32", lambda: (torch.backends.cuda.matmul.allow_tf32,
                                        torch.backends.cudnn.allow_tf32)),
                      ("mkldnn", lambda: torch.backends.mkldnn.enabled),
                      ("autocast", lambda: (torch.is_autocast_enabled("cpu"),
                                            torch.get_autocast_dtype("cpu")))):
        try:
            flags[name] = get()
        except Exception as err:  # a build without the backend: its absence is the state
            flags[name] = type(err).__name__
    return {
        "include": str(c._dispatch_tls_local_include_set()),
        "exclude": str(c._dispatch_tls_local_exclude_set()),
        "function_modes": [c._get_function_stack_at(i) for i in range(c._len_torch_function_stack())],
        "dispatch_modes": [c._get_dispatch_stack_at(i) for i in range(c._len_torch_dispatch_stack())],
        "torch_function_state": c._get_torch_function_state(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "fwd_grad": c._is_fwd_grad_enabled(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "default_dtype": torch.get_default_dtype(),
        "default_device": torch.get_default_device(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
        "rng": torch.get_rng_state().tolist(),
        "profile": sys.getprofile(),
        "trace": sys.gettrace(),
        "tensor_methods": {k: id(v) for k, v in vars(torch.Tensor).items()},
        "module_hooks": [len(d) for d in (
            nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
            nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)],
        **flags,
    }


def assert_state_as_eager(fn: Callable[[], Any], **options: Any) -> None:
    """Run ``fn`` in plain eager and under the engine (same seed each) and require the global
    state after the context to be the state after eager (``global_state``). The engine's
    one-time, process-wide hooks are installed first by a context of their own (then forgotten:
    the run under the engine starts from a fresh engine)."""
    with ae.adaptive_eager(**options):
        torch.ones(2).add_(1).sum().item()
    ae.clear_caches()
    torch.manual_seed(99)
    fn()
    want = global_state()
    torch.manual_seed(99)
    with ae.adaptive_eager(**options):
        fn()
    got = global_state()
    diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not diff, diff

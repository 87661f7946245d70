"""Memory the outside can see: storages that code outside torch's dispatch reads or writes.

Note [memory the outside can see]
A deferred op is safe only while nobody but torch can look at the memory it reads or writes: a
flush happens before every read that reaches Python or the dispatcher. Some memory is shared
with readers and writers the engine never sees: a numpy array of a tensor (``t.numpy()``,
``np.asarray(t)``) or a tensor of a numpy array (``torch.from_numpy``, ``torch.as_tensor`` and
``torch.asarray`` when they alias it), DLPack capsules both ways (``__dlpack__``,
``torch.utils.dlpack.to_dlpack``/``from_dlpack``, ``np.from_dlpack(t)``), ``torch.frombuffer``,
shared memory (``share_memory_()``) and shared file mappings (``from_file(shared=True)``).
numpy reads an array without any Python call torch could hook, and writes it the same way, so a
write deferred to such memory (``z.add_(1)`` after ``n = z.numpy()``) would be read stale, and a
read deferred from it would see numpy's later writes.

So the moment memory escapes, its storage is noted here (``ESCAPED``: storage address -> the
tokens that keep the escape alive: a weak reference to the outside object where one exists, the
numpy array of ``t.numpy()``, else the storage itself) after the pending trace ran (whatever it
reads or writes there lands first). From then on an op on a tensor of that storage is not
deferred: the engine numbers every tensor from outside the trace at its first use in a trace
(Trace.register, and its C twin in _hot.c), and an escaped storage's tensor refuses to be
numbered there (Unsupported), so the op runs at once after a flush, as in eager. The check costs
nothing per op: one empty-dict test at a first use, a dict lookup while anything has escaped.
An escape ends with its tokens (the array is gone, the storage is freed); dead entries are
pruned as the table grows. Raw pointers (``data_ptr()``) and storage objects only flush when
they are taken: torch's own code takes them for identity checks on every parameter, and a
pointer can only be read through ctypes or C code, which must call ``adaptive_eager.sync()``
before it reads memory that torch wrote since.

The other members of the class are C++ functions that read a tensor's memory without the
dispatcher: the sparse constructors' invariant checks, ``as_subclass``/``_make_subclass`` (which
alias the tensor below the dispatcher), ``to_dlpack``. They get the pending trace run and real
values, as the Python-level reads of lazy.py do.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from adaptive_eager.core import hooks
from adaptive_eager.dispatch.lazy import LazyTensor, resolve_all

_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction
_storage = torch._C.TensorBase.untyped_storage  # not torch.Tensor's wrapper (mode.py)
_T = torch.Tensor

# storage data address -> tokens keeping its escape alive (_hot.c reads it: Note above)
ESCAPED: dict[int, list[Any]] = {}
_prune_at = 64


class _StorageRef:
    """A weak reference to a StorageImpl (as torch.multiprocessing's StorageWeakRef)."""

    __slots__ = ("cdata",)

    def __init__(self, st: torch.UntypedStorage) -> None:
        self.cdata = st._weak_ref()

    def __call__(self) -> bool | None:
        return None if torch.UntypedStorage._expired(self.cdata) else True

    def __del__(self) -> None:
        free = getattr(torch.UntypedStorage, "_free_weak_ref", None)
        if free is not None:  # absent at interpreter shutdown
            free(self.cdata)


def note_escape(t: Any, holder: Any = None) -> None:
    """``t``'s memory is now visible outside torch: while ``holder`` (weakly referenced; None:
    the storage) lives, ops on tensors of that storage run at once."""
    if not isinstance(t, _T):
        return
    if t.layout is not torch.strided or t.device.type == "meta":
        return
    if type(t) is LazyTensor:
        t = t._ae_real
        if t is None:
            return
    with _DisableFunction():
        note_storage_escape(_storage(t), holder)


def note_storage_escape(st: torch.UntypedStorage, holder: Any = None) -> None:
    """A storage's memory is now visible outside torch (as note_escape)."""
    global _prune_at
    with _DisableFunction():
        if st.nbytes() == 0 or st.device.type == "meta":
            return
        addr = st.data_ptr()
    token: Any
    try:
        token = weakref.ref(holder) if holder is not None else _StorageRef(st)
    except TypeError:  # not weakly referenceable: the storage's life
        token = _StorageRef(st)
    ESCAPED.setdefault(addr, []).append(token)
    if len(ESCAPED) > _prune_at:
        for a in list(ESCAPED):
            escaped(a)
        _prune_at = max(64, 2 * len(ESCAPED))


def escaped(addr: int) -> bool:
    """Whether the storage at ``addr`` is visible outside torch (drops dead escapes)."""
    tokens = ESCAPED.get(addr)
    if tokens is None:
        return False
    live = [tok for tok in tokens if tok() is not None]
    if live:
        if len(live) != len(tokens):
            ESCAPED[addr] = live
        return True
    del ESCAPED[addr]
    return False


def _flush(reason: str) -> None:
    """Run this thread's pending trace first (never from inside the engine's own work)."""
    if hooks.flush_before_handoff is not None:  # Note [hook slots] in core/hooks.py
        hooks.flush_before_handoff(reason)


def _engine_on_top() -> bool:
    n = torch._C._len_torch_dispatch_stack()
    return bool(n) and type(torch._C._get_dispatch_stack_at(n - 1)) is hooks.engine_mode


def _call_now(orig: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``orig`` at once, below the engine's dispatch mode when it is on top: the aten ops
    it makes on its way run on real values, not deferred into wrappers it would then read."""
    if _engine_on_top():
        with _DisableDispatch():
            return orig(*args, **kwargs)
    return orig(*args, **kwargs)


def _mark(wrapper: Any) -> Any:
    wrapper._ae_hook = True
    return wrapper


# ---- memory coming in from outside: the new tensor aliases or copies it ----------------------
def _foreign(src: Any) -> bool:
    """Whether a constructor's source is memory of another library (not a tensor, not Python
    numbers)."""
    return src is not None and not isinstance(src, (_T, list, tuple, int, float, complex, bool))


def _from_outside(name: str, aliases: bool | None, orig: Any) -> Any:
    """A constructor of a tensor from another library's memory: ``from_numpy``, ``frombuffer``,
    ``from_dlpack`` (``aliases``: always aliasing), ``as_tensor``/``asarray`` (None: aliasing
    unless they must copy), ``tensor`` (False: a copy). What it reads of that memory it reads at
    once, below the engine: a copy deferred to a flush (``as_tensor(a, dtype=...)`` is an aten
    ``_to_copy`` of a numpy-backed tensor) would read what the outside wrote meanwhile."""

    @functools.wraps(orig)
    def make(*args: Any, **kwargs: Any) -> Any:
        src = args[0] if args else next(iter(kwargs.values()), None)
        foreign = _foreign(src)
        out = _call_now(orig, *args, **kwargs) if foreign else orig(*args, **kwargs)
        if aliases or (aliases is None and foreign and _foreign_alias(src, out)):
            note_escape(out)
        return out

    return _mark(make)


def _foreign_alias(src: Any, out: Any) -> bool:
    """Whether ``out`` may alias the memory of ``src``, an object that is not a tensor."""
    if type(out) is not _T:
        return False
    face = getattr(src, "__array_interface__", None)
    if isinstance(face, dict) and isinstance(face.get("data"), tuple):
        start = face["data"][0]
        size = getattr(src, "nbytes", None)
        if not isinstance(size, int):
            return True
        with _DisableFunction():
            st = _storage(out)
            lo = st.data_ptr()
            hi = lo + st.nbytes()
        return lo < start + size and start < hi
    return True  # a buffer, DLPack or CUDA array: may alias, kept as escaped


def _from_file(orig: Any) -> Any:
    @functools.wraps(orig)
    def make(*args: Any, **kwargs: Any) -> Any:
        out = _call_now(orig, *args, **kwargs)  # it reads the file now, as eager does
        shared = args[1] if len(args) > 1 else kwargs.get("shared")
        if shared:  # a shared mapping: other processes and the file see its writes
            if isinstance(out, _T):
                note_escape(out)
            else:
                note_storage_escape(out)
        return out

    return _mark(make)


def _share_memory(orig: Any) -> Any:
    @functools.wraps(orig)
    def share(self: Any, *args: Any, **kwargs: Any) -> Any:
        _flush("read:share_memory_")
        out = orig(self, *args, **kwargs)
        note_storage_escape(self)  # after the move: its new address
        return out

    return _mark(share)


# ---- memory going out: the outside gets a tensor's memory ------------------------------------
def _to_dlpack(orig: Any) -> Any:
    @functools.wraps(orig)
    def to_dlpack(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        _flush("read:to_dlpack")
        tensor = resolve_all(tensor)
        out = orig(tensor, *args, **kwargs)
        note_escape(tensor)  # a capsule has no weak references: the storage's life
        return out

    return _mark(to_dlpack)


# ---- C++ readers below the dispatcher --------------------------------------------------------
def _on_values(name: str, orig: Any) -> Any:
    """A function that reads its tensors' memory in C++ (sparse invariant checks): pending
    writes land first, lazy arguments give their values, and the aten ops it makes on its way
    (conversions, the checks' reductions) run at once on real values, not deferred into
    wrappers it would then read. Its result is sparse: the engine runs that at once anyway."""

    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        _flush(f"read:{name}")
        args, kwargs = resolve_all(args), {k: resolve_all(v) for k, v in kwargs.items()}
        return _call_now(orig, *args, **kwargs)

    return _mark(call)


def _index_values(orig: Any, at: int, names: tuple[str, ...]) -> Any:
    """A composite that reads an index tensor's data in C++ (``tensor_split``'s tensor of
    indices): a pending index is computed first, so C++ reads its value, not a wrapper's absent
    data. Other calls (sections as ints, a real index) pay one type check."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > at and type(args[at]) is LazyTensor:
            args = (*args[:at], resolve_all(args[at]), *args[at + 1:])
        elif kwargs:
            for name in names:
                if type(kwargs.get(name)) is LazyTensor:
                    kwargs = {**kwargs, name: resolve_all(kwargs[name])}
        return orig(*args, **kwargs)

    functools.update_wrapper(call, orig)
    return _mark(call)


def _subclassing(orig: Any, at: int) -> Any:
    """``as_subclass``/``_make_subclass``: C aliases (or detaches) the tensor and wraps the
    result in a new Python object of the class. Under the engine the alias would reach its
    dispatch mode, which hands back a Python object of its own (the wrap then fails) or a lazy
    wrapper: it is made on the real value, below the dispatcher."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > at and (type(args[at]) is LazyTensor or _engine_on_top()):
            args = (*args[:at], resolve_all(args[at]), *args[at + 1:])
            with _DisableDispatch():
                return orig(*args, **kwargs)
        return orig(*args, **kwargs)

    functools.update_wrapper(call, orig)
    return _mark(call)


_SPARSE = ("sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
           "sparse_bsc_tensor", "sparse_compressed_tensor", "_sparse_coo_tensor_unsafe",
           "_sparse_compressed_tensor_unsafe", "_validate_sparse_coo_tensor_args",
           "_validate_sparse_compressed_tensor_args", "_validate_sparse_csr_tensor_args",
           "_validate_sparse_csc_tensor_args", "_validate_sparse_bsr_tensor_args",
           "_validate_sparse_bsc_tensor_args")


def _set(owner: Any, name: str, make: Any) -> None:
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, "_ae_hook", False):
        return
    setattr(owner, name, make(orig))


def _cuda_array_interface(prop: property) -> property:
    """``__cuda_array_interface__`` (CUDA tensors; CuPy, Numba): a raw pointer the consumer
    reads and writes from then on."""

    def get(self: Any) -> Any:
        _flush("read:__cuda_array_interface__")
        real = resolve_all(self)
        out = prop.fget(real)  # type: ignore[misc]
        note_escape(real)
        return out

    get.__doc__ = prop.__doc__
    return property(_mark(get), doc=prop.__doc__)


def install() -> None:
    """Installed when the package is imported (idempotent): code that took a reference to one
    of these functions before that keeps the plain one."""
    import torch.utils.dlpack as dlpack

    for name in ("from_numpy", "frombuffer", "from_dlpack"):
        _set(torch, name, functools.partial(_from_outside, name, True))
    _set(dlpack, "from_dlpack", functools.partial(_from_outside, "from_dlpack", True))
    for name in ("as_tensor", "asarray"):
        _set(torch, name, functools.partial(_from_outside, name, None))
    _set(torch, "tensor", functools.partial(_from_outside, "tensor", False))
    _set(torch, "from_file", _from_file)
    _set(torch.UntypedStorage, "from_file", lambda orig: staticmethod(_from_file(orig)))
    _set(torch.storage._StorageBase, "share_memory_", _share_memory)
    _set(torch, "to_dlpack", _to_dlpack)
    _set(dlpack, "to_dlpack", _to_dlpack)
    for name in _SPARSE:
        _set(torch, name, functools.partial(_on_values, name))
    split_names = ("indices_or_sections", "tensor_indices_or_sections", "indices")
    _set(torch, "tensor_split", lambda orig: _index_values(orig, 1, split_names))
    _set(_T, "tensor_split", lambda orig: _index_values(orig, 1, split_names))
    _set(_T, "as_subclass", lambda orig: _subclassing(orig, 0))
    _set(_T, "_make_subclass", lambda orig: staticmethod(_subclassing(orig, 1)))
    prop = _T.__dict__.get("__cuda_array_interface__")
    if isinstance(prop, property) and not getattr(prop.fget, "_ae_hook", False):
        _T.__cuda_array_interface__ = _cuda_array_interface(prop)  # type: ignore[misc]

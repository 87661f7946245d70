/* adaptive_eager._hot: the engine's per-op hot path in C, CPython API only.
 *
 * Note [C accelerator]
 * A recorded op on a known trace spends about 13k instructions in the engine's own Python
 * (DeferMode.__torch_dispatch__ and Engine.record, Note [hot path costs] in engine.py). This
 * module does the common case of that work in C: ``dispatch`` is installed as the mode's
 * ``__torch_dispatch__`` (a bound method on the DeferMode instance, so torch calls C with no
 * Python frame; ADAPTIVE_EAGER_ACCEL=0 leaves the Python method), and records the op itself when
 *   - the op's OpSpec (``func._ae_spec``) has the DEFER policy (``_to_copy`` only without a
 *     ``device`` keyword: mode._copies_to_other_device is false) and no boolean-mask index, or
 *     it is an attention op deferred because it draws nothing (RANDOM policy, ``dropout_p`` 0,
 *     Note [attention without dropout] in mode.py: then only the foreign check applies);
 *   - none of the mode's early exits can apply: the first argument is a pending lazy tensor and
 *     the op is no view of another argument, or else ``types`` holds only LazyTensor (no
 *     foreign subclass), a view's base is a pending lazy tensor and the op is surely no
 *     host-scalar op (a lazy tensor among the arguments, no tensor at all (arange, full), or a
 *     real Tensor/Parameter with more than one element or off the CPU: ``embedding(weight,
 *     ids)``). Where C's checks already know the exit (a view of a real tensor, an op on real
 *     CPU scalars) it takes it itself: ``M.ops_intercepted``, then ``eng.run_view`` /
 *     ``eng.run_host_scalar``, what the Python handler does after the same checks
 *     (``stats()["handed"]``);
 *   - every tensor argument (positional, in a list, or a keyword) is a pending lazy tensor of
 *     this trace, a tensor already numbered in ``tr.ext_ids``, or a first use C can number
 *     (Note [first uses in C]); the other arguments are numbers, lists/tuples of those, or
 *     objects keyed as themselves (None, dtypes, devices, ...);
 *   - the trie has a child for the key, or the trace runs on a fitted template (Note
 *     [symbolic dims] in shapes.py) and this is a memoised step of it: ``tr.node.sym`` is
 *     ``(tpl, i)``, ``tr.sym.tpl is tpl``, tpl is not dead, ``i < len(tpl.steps)`` and
 *     ``tpl.memo[tr.sym.s][i]`` holds this key (one tuple compare, Note [template memo]);
 *     then, as shapes.step does, the key and outputs go on ``tr.sym.keys``/``outs``,
 *     ``tr.node`` becomes ``tpl.nodes[i]`` and ``M.sym_ops`` counts it (``stats()["sym"]``);
 *   - the output (the child's, or the memoised one) is one ``Meta`` (a new lazy tensor), an
 *     int (an in-place op returning that argument), None, or a flat tuple/list of those;
 *   - nothing else is due: the op would not arm the read guard (``_note_writes``), the trace is
 *     below its cap, its slot has a shared marker, and no other thread is running the trace.
 * Anything else (and any error while checking) calls the Python ``__torch_dispatch__``, which
 * runs unchanged, so behaviour outside the fast case is the Python path's by construction.
 * Inside it, the key, ``margs``, scalars, ``tr.last``, the numbering of first uses, the trie
 * step, the output wrapper (the same ``_make_wrapper_subclass`` call and attributes), its weak
 * reference, the ``tr.ops`` entry and the counters are exactly the Python path's
 * (tests/test_accel.py compares traces). Every check runs before the first change to the
 * trace: a fast-case op that fails a check has changed nothing and goes to Python whole.
 * Where no step can follow (a trace off the trie, a node with no continuation and no template
 * step) that is known before the key is built, and the op goes to Python at once. Errors
 * raised while checking are counted (``stats()["faults"]``) and the Python path then runs the
 * op as it always would. Attributes of the engine's __slots__ classes are read at their member
 * offsets (checked by exact type), the engine's in its instance dict: what generic attribute
 * access does, cheaper.
 * Left to Python: views of real tensors and host-scalar ops (run by the engine's own methods,
 * handed over as above), other random ops, grad-mode, sync and out= ops, device copies, nested
 * outputs, trie misses, the op that arms the read guard, the cap flush, first uses C does not
 * number; of templates, the anchor step (``node.sym`` a list: it binds s), the first run at
 * each s (the memo is empty: the key is matched against the step's pattern), another key at a
 * step (another template may go on, or the trace leaves the template), a dead template. Share
 * of a config-built GPT-2 generate() (32 tokens, engine kept on, repeated) recorded in C: 12%
 * with trie hits only, 70% with template steps, 89.5% with first uses in C (the rest: views of
 * real tensors, host-scalar ops, ``.item()``, template anchors).
 *
 * Note [first uses in C]
 * Trace.register numbers a tensor from outside the trace at its first use: key part ('x',
 * mid, group), ``ext``/``ext_ids``/``groups`` updates, ``owner.shared`` for another engine's
 * lazy tensor. C does its common case (``reg``): an exact Tensor/Parameter whose layout is
 * strided, not quantized, not nested, not on meta, with neither the conj nor the neg bit (a
 * conj/neg view goes to Python), or a LazyTensor holding its value (its ``_ae_meta``, storage
 * of its ``_ae_real``). It reads what Trace.register reads, with Python-level getters; Python
 * reads them with torch-function modes off, so C numbers nothing while a mode is on the stack
 * during dispatch (``torch._C._is_torch_function_mode_enabled``: the read guard, a user's
 * mode). Metas: C looks the keys up in intern_meta's own dict (``core.meta._METAS``); meta_of(t)
 * interns the metadata with its storage offset and register the offset-0 one, and both must be
 * interned already, else Python numbers it: C never interns, so mids keep the Python path's
 * order (a fresh-process test compares them). No cache: a tensor's metadata can change in
 * place (``.data =``, set_, resize_), so it is read at every first use (about 14k
 * instructions, most in torch's getters). The numbering is noted while checking (a tensor used
 * twice in the op, or two views of one storage, see the notes made before them) and made at
 * commit, in order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define MAX_ARGS 32    /* positional + keyword arguments handled by the fast path */
#define MAX_PENDING 64 /* pending lazy inputs (incl. inside lists) */
#define MAX_SCALARS 64
#define MAX_OUTS 16

static PyObject *LazyT, *TensorT, *ParamT, *MetaT, *SLOTS, *make_wrapper, *set_bits, *Mobj,
    *NO_KWARGS, *TO_COPY, *fallback, *DEFER, *EngineT;
static PyObject *TemplateT, *SymTraceT; /* shapes.Template, shapes.SymTrace (NULL: no template steps) */
/* init_register's: core.meta._METAS, torch.strided, TensorBase.untyped_storage,
 * torch._C._is_torch_function_mode_enabled (METAS NULL: first uses left to Python) */
static PyObject *METAS, *STRIDED, *storage_fn, *tf_mode_on;
/* init_register's fifth: outside.ESCAPED ({storage address: tokens}; Note [memory the outside
 * can see] in dispatch/outside.py): a first use on an address there goes to Python */
static PyObject *ESCAPED;
/* init_dropouts': {OpSpec: position of dropout_p} of the attention ops deferred without dropout
 * (mode._DROPOUT_AT less the no-op dropouts), opspec.RANDOM (NULL: left to Python) */
static PyObject *DROPOUTS, *RANDOM_P;
static int ready = 0;
/* Attributes of the engine's __slots__ classes (Trace, TrieNode, OpSpec, Meta, Metrics) are read
 * and written at their member offsets when the object's type is exactly the class seen at init
 * (what the member descriptor itself does); anything else takes the generic attribute path. */
typedef struct {
    PyTypeObject *t;
    Py_ssize_t off; /* -1: not a plain object member */
} Fast;
#define SLOTPTR(o, f) ((PyObject **)((char *)(o) + (f)->off))
#define GET(o, nm) fget((o), s_##nm, &f_##nm)
#define SET(o, nm, v) fset((o), s_##nm, &f_##nm, (v))

static Fast f_ops, f_ext_ids, f_last, f_scalars, f_node, f_n_slots, f_refs, f_children, f_out, f_policy, f_view_arg, f_bool_index, f_structural, f_scalar_pos, f_scalar_kw, f_writes, f_wrapper_args, f_bits, f_ops_intercepted, f_ops_deferred;
/* template steps: Trace.sym, TrieNode.sym, SymTrace.{tpl,s,outs,keys}, Template.{dead,steps,nodes,memo}, Metrics.sym_ops */
static Fast f_tr_sym, f_node_sym, f_st_tpl, f_st_s, f_st_outs, f_st_keys, f_tpl_dead, f_tpl_steps, f_tpl_nodes, f_tpl_memo, f_sym_ops;
/* first uses: Trace.{ext,groups,engine}, Meta.{mid,size,stride,dtype,device} */
static Fast f_ext, f_groups, f_tr_engine, f_mid, f_msize, f_mstride, f_mdtype, f_mdevice;

static inline PyObject *
fget(PyObject *o, PyObject *name, Fast *f)
{
    if (f != NULL && Py_TYPE(o) == f->t && f->off >= 0) {
        PyObject *v = *SLOTPTR(o, f);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(o, name);
}

static inline int
fset(PyObject *o, PyObject *name, Fast *f, PyObject *v)
{
    if (f != NULL && Py_TYPE(o) == f->t && f->off >= 0) {
        Py_INCREF(v);
        Py_XSETREF(*SLOTPTR(o, f), v);
        return 0;
    }
    return PyObject_SetAttr(o, name, v);
}

/* The member offset of ``name`` in ``type`` (a __slots__ entry), or -1. */
static void
fast_init(Fast *f, PyObject *type, const char *name)
{
    PyTypeObject *old = f->t;
    Py_INCREF(type); /* fget/fset compare against it: it must not be freed and reused */
    f->t = (PyTypeObject *)type;
    Py_XDECREF(old);
    f->off = -1;
    PyObject *d = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, name); /* borrowed */
    if (d != NULL && Py_TYPE(d) == &PyMemberDescr_Type) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY))
            f->off = m->offset;
    }
}

static PyObject *ONE, *ZERO;
static Py_ssize_t n_fast = 0, n_slow = 0, n_fault = 0, n_sym = 0, n_ext = 0, n_handed = 0;

static PyObject *s_ae_spec, *s_policy, *s_view_arg, *s_engine, *s_trace, *s_busy, *s_foreign,
    *s_ops, *s_ext_ids, *s_last, *s_scalars, *s_node, *s_children, *s_out, *s_n_slots, *s_refs,
    *s_ae_trace, *s_ae_real, *s_ae_slot, *s_ae_meta, *s_wrapper_args, *s_bits, *s_structural,
    *s_scalar_pos, *s_scalar_kw, *s_writes, *s_ext_writes, *s_cap, *s_bool_index,
    *s_ops_intercepted, *s_ops_deferred, *s_sym, *s_tpl, *s_s, *s_outs, *s_keys, *s_dead,
    *s_steps, *s_nodes, *s_memo, *s_sym_ops;
static PyObject *s_x, *s_ext, *s_groups, *s_shared, *s_mid, *s_size, *s_stride, *s_dtype,
    *s_device, *s_layout, *s_is_quantized, *s_is_nested, *s_type, *s_is_conj, *s_is_neg,
    *s_shape, *s_storage_offset, *s_data_ptr, *s_numel, *s_run_view, *s_run_host_scalar,
    *s_dropout_p, *s_p;

#define MAX_NEW_EXT 64 /* first uses of externals numbered in C per op */
/* A first use noted while checking (Trace.register's changes, made at commit). */
typedef struct {
    PyObject *t;     /* the tensor */
    PyObject *addr;  /* its storage's address */
    PyObject *group; /* its alias group's index */
    PyObject *owner; /* another engine, whose lazy tensor this is (owner.shared), or NULL */
    int new_group;   /* groups[addr] = group at commit */
} NewExt;

typedef struct {
    PyObject *tr;          /* borrowed from the engine for the call (held by a reference) */
    PyObject *ext_ids;
    PyObject *spec;
    Py_ssize_t n_slots_list;
    int structural;
    PyObject *scalar_pos;  /* frozenset */
    PyObject *scalar_kw;
    Py_ssize_t pending[MAX_PENDING];
    int n_pending;
    PyObject *scalars[MAX_SCALARS]; /* borrowed: they live in args/kwargs */
    int n_scalars;
    /* first uses (reg): tr.ext, tr.groups and their sizes, read at the first one */
    PyObject *ext, *groups;
    Py_ssize_t n_ext0, n_groups0;
    int n_new_groups, tf_checked, n_nx;
    NewExt nx[MAX_NEW_EXT];
} Ctx;

static void
ctx_clear(Ctx *c)
{
    for (int k = 0; k < c->n_nx; k++) {
        Py_DECREF(c->nx[k].t);
        Py_DECREF(c->nx[k].addr);
        Py_DECREF(c->nx[k].group);
        Py_XDECREF(c->nx[k].owner);
    }
    c->n_nx = 0;
    Py_CLEAR(c->ext);
    Py_CLEAR(c->groups);
}

/* An error while checking: not the fast case. AttributeError is an expected "no" (an object
 * without the engine's attributes); any other Exception is counted as a fault. -1: not an
 * Exception (KeyboardInterrupt, SystemExit): it stays set and propagates, as it would from
 * the Python path (whose handler catches Exception only). */
static int
note_error(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        n_fault++;
    PyErr_Clear();
    return 0;
}

/* 1 true, 0 false, -1 error */
static int
is_pending_of(PyObject *a, PyObject *tr, int *of_tr)
{
    PyObject *t = PyObject_GetAttr(a, s_ae_trace);
    if (t == NULL)
        return -1;
    PyObject *r = PyObject_GetAttr(a, s_ae_real);
    if (r == NULL) {
        Py_DECREF(t);
        return -1;
    }
    *of_tr = (t == tr);
    int pending = (r == Py_None);
    Py_DECREF(t);
    Py_DECREF(r);
    return pending;
}

/* a._ae_real is None: 1 true, 0 false, -1 error */
static int
is_pending(PyObject *a)
{
    PyObject *r = PyObject_GetAttr(a, s_ae_real);
    if (r == NULL)
        return -1;
    int pending = (r == Py_None);
    Py_DECREF(r);
    return pending;
}

/* No torch-function mode is on (1; remembered for the op), 0 one is, -1 error. A mode would
 * see C's reads of a tensor (Trace.register reads with modes off, so C leaves them to it). */
static int
tf_modes_off(Ctx *c)
{
    if (c->tf_checked)
        return 1;
    if (tf_mode_on == NULL)
        return 0; /* init_register not called: C does not know */
    PyObject *on = PyObject_CallNoArgs(tf_mode_on);
    if (on == NULL)
        return -1;
    Py_DECREF(on);
    if (on != Py_False)
        return 0;
    c->tf_checked = 1;
    return 1;
}

/* A real CPU tensor with at most one element (what mode.is_host_scalar_op asks of each
 * tensor, in its order): 1 yes, 0 no, -1 error. */
static int
host_scalar(PyObject *a)
{
    PyObject *self[1] = {a};
    PyObject *n = PyObject_VectorcallMethod(s_numel, self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            NULL);
    if (n == NULL)
        return -1;
    int big = PyObject_RichCompareBool(n, ONE, Py_GT);
    Py_DECREF(n);
    if (big != 0)
        return big < 0 ? -1 : 0;
    PyObject *dev = PyObject_GetAttr(a, s_device);
    if (dev == NULL)
        return -1;
    PyObject *dt = PyObject_GetAttr(dev, s_type);
    Py_DECREF(dev);
    if (dt == NULL)
        return -1;
    int cpu = PyUnicode_Check(dt) && PyUnicode_CompareWithASCIIString(dt, "cpu") == 0;
    Py_DECREF(dt);
    return cpu;
}

/* Whether mode.is_host_scalar_op is surely false (1): a LazyTensor is among the arguments or
 * inside a list/tuple argument, no tensor is there at all (a factory op: arange, full), or a
 * real Tensor/Parameter has more than one element or is off the CPU (``embedding(weight,
 * ids)``). 2: surely true (real CPU scalars only). 0: C does not know (a tensor subclass, a
 * torch-function mode on: Python asks). -1: an error. */
static int
not_host(Ctx *c, PyObject *args)
{
    int tensors = 0;
    Py_ssize_t na = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        if ((PyObject *)Py_TYPE(a) == LazyT)
            return 1;
        if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
            Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
            PyObject **xs = PySequence_Fast_ITEMS(a);
            for (Py_ssize_t j = 0; j < n; j++) {
                if ((PyObject *)Py_TYPE(xs[j]) == LazyT)
                    return 1;
                tensors |= PyObject_TypeCheck(xs[j], (PyTypeObject *)TensorT);
            }
        }
        else
            tensors |= PyObject_TypeCheck(a, (PyTypeObject *)TensorT);
    }
    if (!tensors)
        return 1;
    /* real tensors only: ask them in is_host_scalar_op's order (pure reads), unless a
     * torch-function mode would see the questions (Python asks them once) */
    int off = tf_modes_off(c);
    if (off <= 0)
        return off;
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int seq = PyList_CheckExact(a) || PyTuple_CheckExact(a);
        /* a list is read afresh at each item: asking a tensor may run Python code */
        for (Py_ssize_t j = 0; j < (seq ? PySequence_Fast_GET_SIZE(a) : 1); j++) {
            PyObject *x = seq ? PySequence_Fast_ITEMS(a)[j] : a;
            PyTypeObject *t = Py_TYPE(x);
            if ((PyObject *)t != TensorT && (PyObject *)t != ParamT) {
                if ((PyObject *)t == LazyT || PyObject_TypeCheck(x, (PyTypeObject *)TensorT))
                    return 0; /* a subclass: Python asks it (a lazy one put there meanwhile) */
                continue;
            }
            Py_INCREF(x);
            int hs = host_scalar(x);
            Py_DECREF(x);
            if (hs <= 0)
                return hs < 0 ? -1 : 1;
        }
    }
    return 2; /* every tensor a CPU scalar: surely a host-scalar op */
}

/* (size, stride, offset, dtype, device, bits): intern_meta's key, as a new reference */
static PyObject *
meta_key(PyObject *size, PyObject *stride, PyObject *offset, PyObject *dtype, PyObject *device,
         PyObject *bits)
{
    PyObject *sz = PySequence_Tuple(size);
    if (sz == NULL)
        return NULL;
    PyObject *st = PySequence_Tuple(stride);
    if (st == NULL) {
        Py_DECREF(sz);
        return NULL;
    }
    PyObject *k = PyTuple_Pack(6, sz, st, offset, dtype, device, bits);
    Py_DECREF(sz);
    Py_DECREF(st);
    return k;
}

/* The interned Meta of ``key`` (new reference), or NULL: not interned yet (no error: Python's
 * intern_meta makes it, in its order) or an error. */
static PyObject *
interned(PyObject *key)
{
    PyObject *m = PyDict_GetItemWithError(METAS, key); /* borrowed */
    if (m == NULL || (PyObject *)Py_TYPE(m) != MetaT)
        return NULL;
    Py_INCREF(m);
    return m;
}

static PyObject *
call0(PyObject *a, PyObject *name)
{
    PyObject *self[1] = {a};
    return PyObject_VectorcallMethod(name, self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The offset-0 Meta Trace.register interns for a plain Tensor/Parameter, as a new reference;
 * NULL with no error where Python must number it (another layout, quantized, nested, on meta,
 * a conj/neg view, metadata not interned yet). */
static PyObject *
plain_meta(PyObject *a)
{
    PyObject *v, *dev = NULL, *size = NULL, *stride = NULL, *off = NULL, *dtype = NULL;
    PyObject *k = NULL, *m = NULL;
    int ok;
    if ((v = PyObject_GetAttr(a, s_layout)) == NULL)
        return NULL;
    ok = v == STRIDED;
    Py_DECREF(v);
    if (!ok)
        return NULL;
    if ((v = PyObject_GetAttr(a, s_is_quantized)) == NULL)
        return NULL;
    ok = v == Py_False;
    Py_DECREF(v);
    if (!ok)
        return NULL;
    if ((v = PyObject_GetAttr(a, s_is_nested)) == NULL)
        return NULL;
    ok = v == Py_False;
    Py_DECREF(v);
    if (!ok)
        return NULL;
    if ((dev = PyObject_GetAttr(a, s_device)) == NULL)
        return NULL;
    if ((v = PyObject_GetAttr(dev, s_type)) == NULL)
        goto done;
    ok = PyUnicode_CheckExact(v) && PyUnicode_CompareWithASCIIString(v, "meta") != 0;
    Py_DECREF(v);
    if (!ok)
        goto done; /* a meta tensor (or a device type that is not a str): Python */
    /* meta_of: bits from is_conj/is_neg; a conj or neg view goes to Python */
    if ((v = call0(a, s_is_conj)) == NULL)
        goto done;
    ok = v == Py_False;
    Py_DECREF(v);
    if (!ok)
        goto done;
    if ((v = call0(a, s_is_neg)) == NULL)
        goto done;
    ok = v == Py_False;
    Py_DECREF(v);
    if (!ok)
        goto done;
    if ((size = PyObject_GetAttr(a, s_shape)) == NULL || (stride = call0(a, s_stride)) == NULL ||
        (off = call0(a, s_storage_offset)) == NULL || (dtype = PyObject_GetAttr(a, s_dtype)) == NULL)
        goto done;
    if (!PyLong_CheckExact(off))
        goto done;
    /* meta_of(t) is interned with its offset first, then register's offset-0 one: both must
     * exist already (else Python interns them, giving the same mids in the same order) */
    if ((k = meta_key(size, stride, off, dtype, dev, ZERO)) == NULL || (m = interned(k)) == NULL)
        goto done;
    int zero = PyObject_RichCompareBool(off, ZERO, Py_EQ);
    if (zero < 0) {
        Py_CLEAR(m);
        goto done;
    }
    if (!zero) {
        Py_CLEAR(m);
        Py_SETREF(k, meta_key(size, stride, ZERO, dtype, dev, ZERO));
        if (k != NULL)
            m = interned(k);
    }
done:
    Py_XDECREF(dev);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(off);
    Py_XDECREF(dtype);
    Py_XDECREF(k);
    return m;
}

/* Trace.register's common case, checked only: the key part ('x', mid, group) as a new
 * reference, the numbering noted in c->nx (made at commit, in order). NULL with no error:
 * Python numbers it (and the op goes there whole). */
static PyObject *
reg(Ctx *c, PyObject *a)
{
    if (METAS == NULL || c->n_nx >= MAX_NEW_EXT)
        return NULL;
    if (tf_modes_off(c) <= 0)
        return NULL; /* a mode on the stack (the read guard, a user's): Python reads */
    if (c->ext == NULL) {
        if ((c->ext = GET(c->tr, ext)) == NULL || (c->groups = GET(c->tr, groups)) == NULL)
            return NULL;
        if (!PyList_CheckExact(c->ext) || !PyDict_CheckExact(c->groups))
            return NULL;
        c->n_ext0 = PyList_GET_SIZE(c->ext);
        c->n_groups0 = PyDict_GET_SIZE(c->groups);
        c->n_new_groups = 0;
    }
    PyObject *m = NULL, *real = NULL, *owner = NULL, *st = NULL, *addr = NULL, *group = NULL;
    PyObject *mid = NULL, *part = NULL;
    int new_group = 0;
    if ((PyObject *)Py_TYPE(a) == LazyT) { /* a lazy tensor holding its value */
        PyObject *meta = PyObject_GetAttr(a, s_ae_meta), *trace;
        if (meta == NULL)
            return NULL;
        if ((PyObject *)Py_TYPE(meta) != MetaT) {
            Py_DECREF(meta);
            return NULL;
        }
        PyObject *size = NULL, *stride = NULL, *dtype = NULL, *device = NULL, *bits = NULL;
        PyObject *k = NULL;
        if ((size = fget(meta, s_size, &f_msize)) != NULL &&
            (stride = fget(meta, s_stride, &f_mstride)) != NULL &&
            (dtype = fget(meta, s_dtype, &f_mdtype)) != NULL &&
            (device = fget(meta, s_device, &f_mdevice)) != NULL && (bits = GET(meta, bits)) != NULL)
            k = meta_key(size, stride, ZERO, dtype, device, bits);
        Py_XDECREF(size);
        Py_XDECREF(stride);
        Py_XDECREF(dtype);
        Py_XDECREF(device);
        Py_XDECREF(bits);
        Py_DECREF(meta);
        if (k == NULL)
            return NULL;
        m = interned(k);
        Py_DECREF(k);
        if (m == NULL)
            return NULL;
        if ((real = PyObject_GetAttr(a, s_ae_real)) == NULL || (trace = PyObject_GetAttr(a, s_ae_trace)) == NULL)
            goto done;
        owner = fget(trace, s_engine, &f_tr_engine);
        Py_DECREF(trace);
        if (owner == NULL)
            goto done;
        PyObject *mine = fget(c->tr, s_engine, &f_tr_engine);
        if (mine == NULL)
            goto done;
        Py_DECREF(mine);
        if (owner == mine) /* else another thread's value: its owner must keep the object */
            Py_CLEAR(owner); /* a lazy tensor (owner.shared, Note [threads ...] in engine.py) */
    }
    else {
        if ((m = plain_meta(a)) == NULL)
            return NULL;
        real = a;
        Py_INCREF(real);
    }
    if ((mid = GET(m, mid)) == NULL)
        goto done;
    if ((st = PyObject_CallOneArg(storage_fn, real)) == NULL ||
        (addr = call0(st, s_data_ptr)) == NULL) {
        /* no storage to read (a ZeroTensor): not the fast case, Trace.register decides */
        if (PyErr_ExceptionMatches(PyExc_RuntimeError))
            PyErr_Clear();
        goto done;
    }
    if (ESCAPED != NULL && PyDict_GET_SIZE(ESCAPED) &&
        (PyDict_GetItemWithError(ESCAPED, addr) != NULL || PyErr_Occurred()))
        goto done; /* memory the outside can see: Trace.register decides */
    /* groups.setdefault(addr, len(groups)), with the first uses noted before this one */
    group = PyDict_GetItemWithError(c->groups, addr);
    if (group != NULL)
        Py_INCREF(group);
    else if (PyErr_Occurred())
        goto done;
    else {
        for (int k = 0; k < c->n_nx && group == NULL; k++) {
            if (!c->nx[k].new_group)
                continue;
            int eq = PyObject_RichCompareBool(c->nx[k].addr, addr, Py_EQ);
            if (eq < 0)
                goto done;
            if (eq) {
                group = c->nx[k].group;
                Py_INCREF(group);
            }
        }
        if (group == NULL) {
            if ((group = PyLong_FromSsize_t(c->n_groups0 + c->n_new_groups)) == NULL)
                goto done;
            new_group = 1;
        }
    }
    if ((part = PyTuple_Pack(3, s_x, mid, group)) == NULL)
        goto done;
    NewExt *e = &c->nx[c->n_nx++];
    Py_INCREF(a);
    e->t = a;
    e->addr = addr;
    e->group = group;
    e->owner = owner;
    e->new_group = new_group;
    c->n_new_groups += new_group;
    addr = group = owner = NULL;
done:
    Py_XDECREF(m);
    Py_XDECREF(real);
    Py_XDECREF(owner);
    Py_XDECREF(st);
    Py_XDECREF(addr);
    Py_XDECREF(group);
    Py_XDECREF(mid);
    return part;
}

/* ~ext_ids[id(a)] as a new reference (or ~ its index among this op's first uses); else its
 * first use, numbered as Trace.register does (reg). NULL with no error: not the fast case. */
static PyObject *
ext_key(Ctx *c, PyObject *a)
{
    PyObject *id = PyLong_FromVoidPtr(a);
    if (id == NULL)
        return NULL;
    PyObject *idx = PyDict_GetItemWithError(c->ext_ids, id); /* borrowed */
    Py_DECREF(id);
    if (idx != NULL)
        return PyNumber_Invert(idx);
    if (PyErr_Occurred())
        return NULL;
    for (int k = 0; k < c->n_nx; k++)
        if (c->nx[k].t == a) /* used again in this op */
            return PyLong_FromSsize_t(~(c->n_ext0 + k));
    return reg(c, a);
}

/* A tensor argument: the key part (new ref) and, for a pending lazy input of this trace, its
 * slot marker (borrowed, else NULL). NULL key with no error: not the fast case. */
static PyObject *
tensor_ref(Ctx *c, PyObject *a, PyObject **marker)
{
    PyTypeObject *t = Py_TYPE(a);
    *marker = NULL;
    if ((PyObject *)t == LazyT) {
        int of_tr = 0;
        int pending = is_pending_of(a, c->tr, &of_tr);
        if (pending < 0)
            return NULL;
        if (pending) {
            if (!of_tr)
                return NULL; /* pending in another trace: Python runs it at once (RunNow) */
            PyObject *s = PyObject_GetAttr(a, s_ae_slot);
            if (s == NULL)
                return NULL;
            Py_ssize_t si = PyLong_AsSsize_t(s);
            if (si < 0 || si >= c->n_slots_list || c->n_pending >= MAX_PENDING) {
                if (si == -1 && PyErr_Occurred())
                    PyErr_Clear();
                Py_DECREF(s);
                return NULL;
            }
            c->pending[c->n_pending++] = si;
            *marker = PyList_GET_ITEM(SLOTS, si);
            return s;
        }
        return ext_key(c, a); /* a lazy tensor holding its value: numbered like a real one */
    }
    if ((PyObject *)t == TensorT || (PyObject *)t == ParamT)
        return ext_key(c, a);
    return NULL; /* a tensor subclass, or not a tensor */
}

static int
add_scalar(Ctx *c, PyObject *a)
{
    if (c->n_scalars >= MAX_SCALARS)
        return -1;
    c->scalars[c->n_scalars++] = a;
    return 0;
}

static PyObject *
type_value(PyObject *a)
{
    return PyTuple_Pack(2, (PyObject *)Py_TYPE(a), a);
}

/* Note [bool keys] in engine.py: a bool keyed by value is one of two constant (bool, value)
 * tuples, equal to no int (True == 1 in a dict); made once in PyInit__hot. A borrowed ref. */
static PyObject *BOOL_KEYS[2];

static PyObject *
value_key(PyObject *a)
{
    return Py_IS_TYPE(a, &PyBool_Type) ? BOOL_KEYS[a == Py_True] : a;
}

static int
is_tensor(PyObject *a)
{
    return PyObject_TypeCheck(a, (PyTypeObject *)TensorT);
}

/* _key_seq: the key of a list/tuple argument (new ref) and the argument with Slot markers
 * (*marked: new ref). NULL with no error: not the fast case. */
static PyObject *
key_seq(Ctx *c, PyObject *seq, PyObject **marked)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *key = PyTuple_New(n);
    PyObject *mk = NULL; /* a list copy, made at the first marker */
    if (key == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *a = items[j];
        PyTypeObject *t = Py_TYPE(a);
        PyObject *k;
        if (is_tensor(a)) {
            PyObject *marker;
            k = tensor_ref(c, a, &marker);
            if (k == NULL)
                goto fail;
            if (marker != NULL) {
                if (mk == NULL) {
                    mk = PyList_New(n);
                    if (mk == NULL) {
                        Py_DECREF(k);
                        goto fail;
                    }
                    for (Py_ssize_t q = 0; q < n; q++) {
                        Py_INCREF(items[q]);
                        PyList_SET_ITEM(mk, q, items[q]);
                    }
                }
                Py_INCREF(marker);
                Py_SETREF(PyList_GET_ITEM(mk, j), marker);
            }
        }
        else if (t == &PyFloat_Type || t == &PyComplex_Type) {
            if (c->structural)
                k = type_value(a);
            else {
                if (add_scalar(c, a) < 0)
                    goto fail;
                k = (PyObject *)t;
                Py_INCREF(k);
            }
        }
        else if (t == &PyLong_Type || t == &PyBool_Type)
            k = type_value(a);
        else {
            k = a;
            Py_INCREF(k);
        }
        if (k == NULL)
            goto fail;
        PyTuple_SET_ITEM(key, j, k);
    }
    if (mk == NULL) {
        Py_INCREF(seq);
        *marked = seq;
    }
    else if (PyTuple_CheckExact(seq)) {
        *marked = PyList_AsTuple(mk);
        Py_DECREF(mk);
        if (*marked == NULL) {
            Py_DECREF(key);
            return NULL;
        }
    }
    else
        *marked = mk;
    return key;
fail:
    Py_XDECREF(mk);
    Py_DECREF(key);
    return NULL;
}

/* Whether Engine._note_writes would arm the read guard for this op: 1 yes, 0 no, -1 error. */
static int
would_arm(Ctx *c, PyObject *writes, PyObject *args, PyObject *kwargs)
{
    PyObject *ws = PySequence_Fast(writes, "writes");
    if (ws == NULL)
        return -1;
    int res = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ws) && !res; i++) {
        PyObject *w = PySequence_Fast_GET_ITEM(ws, i);
        PyObject *a;
        if (PyLong_CheckExact(w)) {
            Py_ssize_t wi = PyLong_AsSsize_t(w);
            if (wi == -1 && PyErr_Occurred()) {
                res = -1;
                break;
            }
            a = (wi >= 0 && wi < PyTuple_GET_SIZE(args)) ? PyTuple_GET_ITEM(args, wi) : Py_None;
        }
        else {
            a = PyDict_GetItemWithError(kwargs, w);
            if (a == NULL) {
                if (PyErr_Occurred()) {
                    res = -1;
                    break;
                }
                a = Py_None;
            }
        }
        PyObject *one[1] = {a};
        PyObject **xs = one;
        Py_ssize_t nx = 1;
        if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
            xs = PySequence_Fast_ITEMS(a);
            nx = PySequence_Fast_GET_SIZE(a);
        }
        for (Py_ssize_t j = 0; j < nx; j++) {
            PyObject *x = xs[j];
            if (!is_tensor(x))
                continue;
            if ((PyObject *)Py_TYPE(x) != LazyT) {
                res = 1;
                break;
            }
            int of_tr = 0;
            int pending = is_pending_of(x, c->tr, &of_tr);
            if (pending < 0) {
                res = -1;
                break;
            }
            if (!of_tr || !pending) {
                res = 1;
                break;
            }
        }
    }
    Py_DECREF(ws);
    return res;
}

static int
get_bool(PyObject *o, PyObject *name, Fast *f)
{
    PyObject *v = fget(o, name, f);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The engine (a plain class, exactly Engine) keeps its state in its instance dict: read and
 * written there, as generic attribute access on it does. */
static PyObject *
eget(PyObject *eng, PyObject *ed, PyObject *name)
{
    if (ed != NULL) {
        PyObject *v = PyDict_GetItemWithError(ed, name);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(eng, name);
}

static int
eset(PyObject *eng, PyObject *ed, PyObject *name, PyObject *v)
{
    return ed != NULL ? PyDict_SetItem(ed, name, v) : PyObject_SetAttr(eng, name, v);
}

static int
eget_bool(PyObject *eng, PyObject *ed, PyObject *name)
{
    PyObject *v = eget(eng, ed, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Add one to an int attribute of the metrics object. */
static int
bump(PyObject *name, Fast *f)
{
    PyObject *v = fget(Mobj, name, f);
    if (v == NULL)
        return -1;
    PyObject *v1 = PyNumber_Add(v, ONE);
    Py_DECREF(v);
    if (v1 == NULL)
        return -1;
    int r = fset(Mobj, name, f, v1);
    Py_DECREF(v1);
    return r;
}

/* A new lazy tensor, as Engine.record (or LazyTensor.__new__) makes one. */
static PyObject *
make_lazy(PyObject *tr, PyObject *meta, PyObject *slot)
{
    PyObject *wa = GET(meta, wrapper_args);
    if (wa == NULL)
        return NULL;
    if (!PyTuple_CheckExact(wa) || PyTuple_GET_SIZE(wa) > 15) {
        Py_DECREF(wa);
        PyErr_SetString(PyExc_TypeError, "Meta.wrapper_args: expected a short tuple");
        return NULL;
    }
    PyObject *stack[16];
    Py_ssize_t nw = PyTuple_GET_SIZE(wa);
    stack[0] = LazyT;
    for (Py_ssize_t q = 0; q < nw; q++)
        stack[q + 1] = PyTuple_GET_ITEM(wa, q);
    PyObject *out = PyObject_Vectorcall(make_wrapper, stack, nw + 1, NULL);
    Py_DECREF(wa);
    if (out == NULL)
        return NULL;
    if (PyObject_SetAttr(out, s_ae_trace, tr) < 0 || PyObject_SetAttr(out, s_ae_slot, slot) < 0 ||
        PyObject_SetAttr(out, s_ae_meta, meta) < 0)
        goto fail;
    int bits = get_bool(meta, s_bits, &f_bits);
    if (bits < 0)
        goto fail;
    if (bits) {
        PyObject *r = PyObject_CallFunctionObjArgs(set_bits, out, meta, NULL);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* A template step (shapes.step on a template's own node, Note [template memo]): the trie
 * missed at ``node``; ``node.sym`` is (tpl, i), the trace is on tpl (``tr.sym.tpl is tpl``),
 * tpl is alive, ``i < len(tpl.steps)`` and ``tpl.memo[s][i] == (key, got)`` with its key equal
 * to ``key``. Then 1, with new references: *state (tr.sym), *outs and *keys (its lists), *next
 * (tpl.nodes[i]) and *got; nothing changed. 0: not this case (the Python path decides, and
 * may match the key's pattern, try another template or leave); -1: an error (set). */
static int
tpl_step(PyObject *node, PyObject *tr, PyObject *key, PyObject **state, PyObject **outs,
         PyObject **keys, PyObject **next, PyObject **got)
{
    PyObject *sym = NULL, *st = NULL, *stpl = NULL, *steps = NULL, *memo = NULL, *s = NULL;
    PyObject *m = NULL, *hit = NULL, *nodes = NULL, *ol = NULL, *kl = NULL;
    int res = -1;
    if ((sym = fget(node, s_sym, &f_node_sym)) == NULL)
        goto done;
    res = 0;
    if (!PyTuple_CheckExact(sym) || PyTuple_GET_SIZE(sym) != 2)
        goto done; /* None, or a list: an anchor (Python) */
    PyObject *tpl = PyTuple_GET_ITEM(sym, 0), *i = PyTuple_GET_ITEM(sym, 1);
    if ((PyObject *)Py_TYPE(tpl) != TemplateT || !PyLong_CheckExact(i))
        goto done;
    Py_ssize_t iv = PyLong_AsSsize_t(i);
    if (iv < 0) {
        res = -(iv == -1 && PyErr_Occurred());
        goto done;
    }
    res = -1;
    if ((st = fget(tr, s_sym, &f_tr_sym)) == NULL)
        goto done;
    res = 0;
    if ((PyObject *)Py_TYPE(st) != SymTraceT)
        goto done; /* None: the trace is on no template */
    res = -1;
    if ((stpl = fget(st, s_tpl, &f_st_tpl)) == NULL)
        goto done;
    res = 0;
    if (stpl != tpl)
        goto done;
    int dead = get_bool(tpl, s_dead, &f_tpl_dead);
    if (dead != 0) {
        res = dead < 0 ? -1 : 0;
        goto done;
    }
    res = -1;
    if ((steps = fget(tpl, s_steps, &f_tpl_steps)) == NULL)
        goto done;
    res = 0;
    if (!PyList_CheckExact(steps) || iv >= PyList_GET_SIZE(steps))
        goto done;
    res = -1;
    if ((memo = fget(tpl, s_memo, &f_tpl_memo)) == NULL || (s = fget(st, s_s, &f_st_s)) == NULL)
        goto done;
    res = 0;
    if (!PyDict_CheckExact(memo))
        goto done;
    /* borrowed items are held: comparing the keys may run Python code */
    if ((m = PyDict_GetItemWithError(memo, s)) == NULL) {
        res = -!!PyErr_Occurred();
        goto done; /* the first run at this s: Python matches and fills the memo */
    }
    Py_INCREF(m);
    if (!PyDict_CheckExact(m))
        goto done;
    if ((hit = PyDict_GetItemWithError(m, i)) == NULL) {
        res = -!!PyErr_Occurred();
        goto done;
    }
    Py_INCREF(hit);
    if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2)
        goto done;
    res = -1;
    if ((nodes = fget(tpl, s_nodes, &f_tpl_nodes)) == NULL ||
        (ol = fget(st, s_outs, &f_st_outs)) == NULL || (kl = fget(st, s_keys, &f_st_keys)) == NULL)
        goto done;
    res = 0;
    if (!PyList_CheckExact(nodes) || iv >= PyList_GET_SIZE(nodes) || !PyList_CheckExact(ol) ||
        !PyList_CheckExact(kl))
        goto done;
    {
        PyObject *eq = PyObject_RichCompare(PyTuple_GET_ITEM(hit, 0), key, Py_EQ);
        int same = eq == NULL ? -1 : PyObject_IsTrue(eq);
        Py_XDECREF(eq);
        if (same != 1) {
            res = same; /* 0: another key at this step (Python matches it), -1: an error */
            goto done;
        }
    }
    *next = PyList_GET_ITEM(nodes, iv);
    Py_INCREF(*next);
    *got = PyTuple_GET_ITEM(hit, 1);
    Py_INCREF(*got);
    *state = st;
    *outs = ol;
    *keys = kl;
    st = ol = kl = NULL;
    res = 1;
done:
    Py_XDECREF(sym);
    Py_XDECREF(st);
    Py_XDECREF(stpl);
    Py_XDECREF(steps);
    Py_XDECREF(memo);
    Py_XDECREF(s);
    Py_XDECREF(m);
    Py_XDECREF(hit);
    Py_XDECREF(nodes);
    Py_XDECREF(ol);
    Py_XDECREF(kl);
    return res;
}

/* DeferMode.__torch_dispatch__'s next step where C's early exits already know it (a view of
 * a real tensor: eng.run_view; a host-scalar op: eng.run_host_scalar): M.ops_intercepted += 1,
 * then eng.<name>(func, spec, args, kwargs or _NO_KWARGS), as the Python handler does after
 * the same checks; its pass over them is skipped. *handed: 1 once the counter moved (the
 * result, or the method's error, is the op's); 0 nothing done (the Python path runs it). */
static PyObject *
hand_off(PyObject *mode, PyObject *name, PyObject *func, PyObject *spec, PyObject *args,
         PyObject *kwargs, int *handed)
{
    *handed = 0;
    PyObject *eng = PyObject_GetAttr(mode, s_engine);
    if (eng == NULL)
        return NULL;
    if (bump(s_ops_intercepted, &f_ops_intercepted) < 0) {
        Py_DECREF(eng);
        return NULL;
    }
    *handed = 1;
    n_slow++;
    n_handed++;
    PyObject *kw = (kwargs == Py_None || PyDict_GET_SIZE(kwargs) == 0) ? NO_KWARGS : kwargs;
    PyObject *stack[5] = {eng, func, spec, args, kw};
    PyObject *r = PyObject_VectorcallMethod(name, stack, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(eng);
    return r;
}

/* The fast path. A new reference on success; NULL with no error set when the op is not the
 * fast case (nothing was changed); NULL with an error only when a change of the trace failed
 * midway (out of memory), which propagates as it would from Engine.record. */
static PyObject *
fast(PyObject *mode, PyObject *func, PyObject *types, PyObject *args, PyObject *kwargs)
{
    PyObject *spec = NULL, *eng = NULL, *tr = NULL, *tmp = NULL, *key = NULL, *margs = NULL;
    PyObject *ops = NULL, *last = NULL, *node = NULL, *children = NULL, *child = NULL;
    PyObject *out_spec = NULL, *out = NULL, *entry = NULL, *slot_obj = NULL;
    PyObject *n_op_obj = NULL, *writes = NULL, *okw = NULL;
    PyObject *kw_marked = NULL;
    PyObject *ed = NULL; /* the engine's instance dict */
    PyObject *sym_state = NULL, *sym_outs = NULL, *sym_keys = NULL; /* a template step's */
    PyObject *news[MAX_OUTS], *newrefs[MAX_OUTS]; /* new lazy outputs, their weak refs */
    int n_new = 0, n_refs = 0;
    PyObject *slots_val = NULL; /* the tr.ops entry's output slots */
    int busy_set = 0, was_handed = 0;
    Ctx c;
    c.n_pending = 0;
    c.n_scalars = 0;
    c.n_nx = 0;
    c.ext = c.groups = NULL;
    c.tf_checked = 0;

    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) == 0)
        return NULL;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    PyObject *a0 = PyTuple_GET_ITEM(args, 0);
    Py_ssize_t nkw = 0;
    if (kwargs != Py_None) {
        if (!PyDict_CheckExact(kwargs))
            return NULL;
        nkw = PyDict_GET_SIZE(kwargs);
    }
    if (nargs + nkw > MAX_ARGS)
        return NULL;

    spec = PyObject_GetAttr(func, s_ae_spec);
    if (spec == NULL)
        goto notfast;
    if (spec == TO_COPY) { /* mode._copies_to_other_device: a device move is a read (Python) */
        PyObject *dev = kwargs == Py_None ? NULL : PyDict_GetItemWithError(kwargs, s_device);
        if (dev == NULL && PyErr_Occurred())
            goto notfast;
        if (dev != NULL && dev != Py_None)
            goto notfast_clean;
    }
    tmp = GET(spec, policy);
    if (tmp == NULL)
        goto notfast;
    int dropout_free = 0; /* a RANDOM attention op that draws nothing: deferred as it is */
    if (tmp != DEFER) { /* policies are small ints: the same object as opspec.DEFER */
        int random = tmp == RANDOM_P && DROPOUTS != NULL;
        Py_CLEAR(tmp);
        if (!random)
            goto notfast_clean;
        /* Note [attention without dropout] in mode.py: _no_dropout(at, args, kwargs), for the
         * ops deferred then (not the dropouts returning their input: at 1) */
        PyObject *at = PyDict_GetItemWithError(DROPOUTS, spec);
        if (at == NULL)
            goto notfast_maybe_err;
        Py_ssize_t ai = PyLong_AsSsize_t(at);
        if (ai == -1 && PyErr_Occurred())
            goto notfast;
        if (ai <= 1)
            goto notfast_clean;
        PyObject *pr = NULL;
        if (nargs > ai)
            pr = PyTuple_GET_ITEM(args, ai);
        else if (kwargs != Py_None) {
            if ((pr = PyDict_GetItemWithError(kwargs, s_dropout_p)) == NULL && !PyErr_Occurred())
                pr = PyDict_GetItemWithError(kwargs, s_p);
            if (pr == NULL && PyErr_Occurred())
                goto notfast;
        }
        if (pr != NULL) { /* else 0.0 */
            if (!PyFloat_CheckExact(pr) && !PyLong_CheckExact(pr))
                goto notfast_clean; /* bool, a subclass, not a number: Python decides */
            int zero = PyObject_RichCompareBool(pr, ZERO, Py_EQ);
            if (zero <= 0)
                goto notfast_maybe_err; /* it draws: run_random */
        }
        /* the Python handler's foreign check comes first for these ops; no other early exit */
        if (!PyTuple_CheckExact(types))
            goto notfast_clean;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(types); j++)
            if (PyTuple_GET_ITEM(types, j) != LazyT)
                goto notfast_clean;
        dropout_free = 1;
    }
    Py_CLEAR(tmp); /* the policy (DEFER): a new reference (NULL already on the branch above) */
    if (!dropout_free) {
        tmp = GET(spec, view_arg);
        if (tmp == NULL)
            goto notfast;
        /* DeferMode.__torch_dispatch__'s early exits apply unless the first argument is a
         * pending lazy tensor and the op is no view of another argument */
        int va = PyObject_IsTrue(tmp);
        if (va < 0)
            goto notfast;
        int direct = 0;
        if ((PyObject *)Py_TYPE(a0) == LazyT && !va) {
            int pending = is_pending(a0);
            if (pending < 0)
                goto notfast;
            direct = pending;
        }
        if (!direct) {
            if (!PyTuple_CheckExact(types))
                goto notfast_clean;
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(types); j++)
                if (PyTuple_GET_ITEM(types, j) != LazyT)
                    goto notfast_clean; /* Note [foreign subclasses]: Python decides */
            if (tmp != Py_None) { /* run_view unless the view's base is pending */
                Py_ssize_t vi = PyLong_AsSsize_t(tmp);
                if (vi == -1 && PyErr_Occurred())
                    goto notfast;
                if (vi >= 0 && vi < nargs) {
                    PyObject *base = PyTuple_GET_ITEM(args, vi);
                    int pending = (PyObject *)Py_TYPE(base) != LazyT ? 0 : is_pending(base);
                    if (pending < 0)
                        goto notfast;
                    if (!pending) { /* a view of a real tensor (or of a value): made at once */
                        Py_CLEAR(tmp);
                        out = hand_off(mode, s_run_view, func, spec, args, kwargs, &was_handed);
                        goto handed;
                    }
                }
            }
            int nh = not_host(&c, args); /* else it may be a host-scalar op: Python decides */
            if (nh == 2) {
                Py_CLEAR(tmp);
                out = hand_off(mode, s_run_host_scalar, func, spec, args, kwargs, &was_handed);
                goto handed;
            }
            if (nh <= 0)
                goto notfast_maybe_err;
        }
        Py_CLEAR(tmp);
    }
    {
        int bi = get_bool(spec, s_bool_index, &f_bool_index);
        if (bi != 0)
            goto notfast_maybe_err;
    }

    eng = PyObject_GetAttr(mode, s_engine);
    if (eng == NULL)
        goto notfast;
    if (Py_TYPE(eng) == (PyTypeObject *)EngineT && (ed = PyObject_GenericGetDict(eng, NULL)) == NULL)
        goto notfast;
    /* Note [threads and lazy tensors] in engine.py: announce, then look (as Engine.record) */
    if (eset(eng, ed, s_busy, Py_True) < 0)
        goto notfast;
    busy_set = 1;
    {
        int fo = eget_bool(eng, ed, s_foreign);
        if (fo != 0)
            goto notfast_maybe_err; /* another thread runs this trace: Python waits on lock */
    }
    tr = eget(eng, ed, s_trace);
    if (tr == NULL)
        goto notfast;
    ops = GET(tr, ops);
    if (ops == NULL)
        goto notfast;
    if (!PyList_CheckExact(ops))
        goto notfast_clean;
    Py_ssize_t n_op = PyList_GET_SIZE(ops);
    {
        PyObject *cap = eget(eng, ed, s_cap);
        if (cap == NULL)
            goto notfast;
        Py_ssize_t capv = PyLong_AsSsize_t(cap);
        Py_DECREF(cap);
        if (capv == -1 && PyErr_Occurred())
            goto notfast;
        if (n_op + 1 >= capv)
            goto notfast_clean; /* the trace-cap flush: Python */
    }
    c.tr = tr;
    c.spec = spec;
    c.ext_ids = GET(tr, ext_ids);
    if (c.ext_ids == NULL)
        goto notfast;
    Py_DECREF(c.ext_ids); /* the trace holds it */
    if (!PyDict_CheckExact(c.ext_ids))
        goto notfast_clean;
    last = GET(tr, last);
    if (last == NULL)
        goto notfast;
    if (!PyList_CheckExact(last))
        goto notfast_clean;
    c.n_slots_list = PyList_GET_SIZE(SLOTS);
    c.structural = get_bool(spec, s_structural, &f_structural);
    if (c.structural < 0)
        goto notfast;
    c.scalar_pos = GET(spec, scalar_pos);
    if (c.scalar_pos == NULL)
        goto notfast;
    Py_DECREF(c.scalar_pos); /* the spec holds it */

    /* Where no step can be taken, Python records the op before the key is built: a trace off
     * the trie (after a miss), a node with no continuation and no template step. */
    node = GET(tr, node);
    if (node == NULL)
        goto notfast;
    if (node == Py_None)
        goto notfast_clean;
    children = GET(node, children);
    if (children == NULL)
        goto notfast;
    if (!PyDict_CheckExact(children))
        goto notfast_clean;
    if (PyDict_GET_SIZE(children) == 0) {
        if (TemplateT == NULL)
            goto notfast_clean;
        PyObject *sym = fget(node, s_sym, &f_node_sym);
        if (sym == NULL)
            goto notfast;
        int step = PyTuple_CheckExact(sym); /* (tpl, i): a template step may follow */
        Py_DECREF(sym);
        if (!step)
            goto notfast_clean;
    }

    /* Would _note_writes arm the read guard? Then Python records the op. */
    writes = GET(spec, writes);
    if (writes == NULL)
        goto notfast;
    if (writes != Py_None) {
        int ew = eget_bool(eng, ed, s_ext_writes);
        if (ew < 0)
            goto notfast;
        if (!ew) {
            int arm = would_arm(&c, writes, args, kwargs == Py_None ? NO_KWARGS : kwargs);
            if (arm != 0)
                goto notfast_maybe_err;
        }
    }

    /* the key and margs, as Engine.record builds them (nothing changes yet) */
    key = PyTuple_New(1 + nargs + 2 * nkw);
    margs = PyTuple_New(nargs);
    if (key == NULL || margs == NULL)
        goto notfast;
    Py_INCREF(spec);
    PyTuple_SET_ITEM(key, 0, spec);
    Py_ssize_t kn = 1;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyTypeObject *t = Py_TYPE(a);
        PyObject *k, *m = a;
        Py_INCREF(m);
        if ((PyObject *)t == LazyT || (PyObject *)t == TensorT || (PyObject *)t == ParamT) {
            PyObject *marker;
            k = tensor_ref(&c, a, &marker);
            if (k == NULL) {
                Py_DECREF(m);
                goto notfast_maybe_err;
            }
            if (marker != NULL) {
                Py_INCREF(marker);
                Py_SETREF(m, marker);
            }
        }
        else if (t == &PyFloat_Type || t == &PyComplex_Type) {
            if (c.structural)
                k = type_value(a);
            else {
                if (add_scalar(&c, a) < 0) {
                    Py_DECREF(m);
                    goto notfast_clean;
                }
                k = (PyObject *)t;
                Py_INCREF(k);
            }
        }
        else if (t == &PyLong_Type || t == &PyBool_Type) {
            if (c.structural)
                k = type_value(a);
            else {
                PyObject *pi = PyLong_FromSsize_t(i);
                int in = pi ? PySet_Contains(c.scalar_pos, pi) : -1;
                Py_XDECREF(pi);
                if (in < 0) {
                    Py_DECREF(m);
                    goto notfast;
                }
                if (in) {
                    if (add_scalar(&c, a) < 0) {
                        Py_DECREF(m);
                        goto notfast_clean;
                    }
                    k = (PyObject *)t;
                    Py_INCREF(k);
                }
                else {
                    k = value_key(a);
                    Py_INCREF(k);
                }
            }
        }
        else if (t == &PyList_Type || t == &PyTuple_Type) {
            PyObject *mk;
            k = key_seq(&c, a, &mk);
            if (k == NULL) {
                Py_DECREF(m);
                goto notfast_maybe_err;
            }
            Py_SETREF(m, mk);
        }
        else if (is_tensor(a)) {
            Py_DECREF(m);
            goto notfast_clean; /* a tensor subclass: Unsupported, or a foreign subclass */
        }
        else {
            k = a;
            Py_INCREF(k);
        }
        if (k == NULL) {
            Py_DECREF(m);
            goto notfast;
        }
        PyTuple_SET_ITEM(key, kn++, k);
        PyTuple_SET_ITEM(margs, i, m);
    }
    if (nkw) { /* Engine._key_kwargs */
        c.scalar_kw = GET(spec, scalar_kw);
        if (c.scalar_kw == NULL)
            goto notfast;
        Py_DECREF(c.scalar_kw);
        PyObject *name, *a;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &name, &a)) {
            PyTypeObject *t = Py_TYPE(a);
            PyObject *k = NULL;
            /* torch's kwargs have str keys (no Python code runs while we walk them); a dict
             * that grows meanwhile must not write past the key tuple */
            if (kn + 2 > 1 + nargs + 2 * nkw || !PyUnicode_CheckExact(name))
                goto notfast_clean;
            Py_INCREF(name);
            PyTuple_SET_ITEM(key, kn++, name);
            if (is_tensor(a)) {
                PyObject *marker;
                k = tensor_ref(&c, a, &marker);
                if (k == NULL)
                    goto notfast_maybe_err;
                if (marker != NULL) {
                    if (kw_marked == NULL && (kw_marked = PyDict_Copy(kwargs)) == NULL) {
                        Py_DECREF(k);
                        goto notfast;
                    }
                    if (PyDict_SetItem(kw_marked, name, marker) < 0) {
                        Py_DECREF(k);
                        goto notfast;
                    }
                }
            }
            else if (t == &PyFloat_Type || t == &PyComplex_Type || t == &PyLong_Type ||
                     t == &PyBool_Type) {
                int scal;
                if (c.structural) {
                    k = type_value(a);
                    scal = -2;
                }
                else if (t == &PyFloat_Type || t == &PyComplex_Type)
                    scal = 1;
                else {
                    scal = PySet_Contains(c.scalar_kw, name);
                    if (scal < 0)
                        goto notfast;
                }
                if (scal == 1) {
                    if (add_scalar(&c, a) < 0)
                        goto notfast_clean;
                    k = (PyObject *)t;
                    Py_INCREF(k);
                }
                else if (scal == 0) {
                    k = value_key(a);
                    Py_INCREF(k);
                }
            }
            else if (t == &PyList_Type || t == &PyTuple_Type) {
                PyObject *mk;
                k = key_seq(&c, a, &mk);
                if (k == NULL)
                    goto notfast_maybe_err;
                if (mk != a) {
                    if (kw_marked == NULL && (kw_marked = PyDict_Copy(kwargs)) == NULL) {
                        Py_DECREF(mk);
                        Py_DECREF(k);
                        goto notfast;
                    }
                    int r = PyDict_SetItem(kw_marked, name, mk);
                    Py_DECREF(mk);
                    if (r < 0) {
                        Py_DECREF(k);
                        goto notfast;
                    }
                }
                else
                    Py_DECREF(mk);
            }
            else {
                k = a;
                Py_INCREF(k);
            }
            if (k == NULL)
                goto notfast;
            PyTuple_SET_ITEM(key, kn++, k);
        }
        if (kn != 1 + nargs + 2 * nkw)
            goto notfast_clean; /* the dict changed size while we walked it */
    }

    /* the trie step (tr.node read before the key: it must not have moved meanwhile) */
    {
        PyObject *now = GET(tr, node);
        if (now == NULL)
            goto notfast;
        Py_DECREF(now);
        if (now != node)
            goto notfast_clean;
    }
    child = PyDict_GetItemWithError(children, key);
    if (child != NULL) {
        Py_INCREF(child);
        out_spec = GET(child, out);
        if (out_spec == NULL)
            goto notfast;
    }
    else {
        /* a miss: a template step's memo hit is taken here (child: the template's next node,
         * out_spec: its memoised outputs), anything else (a real miss, an anchor, a first
         * run at this s, leaving the template) is Python's */
        if (PyErr_Occurred() || TemplateT == NULL)
            goto notfast_maybe_err;
        int ts = tpl_step(node, tr, key, &sym_state, &sym_outs, &sym_keys, &child, &out_spec);
        if (ts != 1)
            goto notfast_maybe_err;
    }


    /* the outputs (engine._outputs): one Meta, an int (in place), None, or a flat tuple/list
     * of those; every new lazy tensor is made here, before the trace changes */
    Py_ssize_t slots = -1;      /* tr.n_slots before this op */
    {
        PyObject *ns = GET(tr, n_slots);
        if (ns == NULL)
            goto notfast;
        slot_obj = ns;
        slots = PyLong_AsSsize_t(ns);
        if (slots == -1 && PyErr_Occurred())
            goto notfast;
        if (slots < 0)
            goto notfast_clean;
    }
    PyTypeObject *ot = Py_TYPE(out_spec);
    if ((PyObject *)ot == MetaT) {
        if (slots >= c.n_slots_list)
            goto notfast_clean; /* slot_marker grows SLOTS: Python */
        out = make_lazy(tr, out_spec, slot_obj);
        if (out == NULL)
            goto notfast;
        news[n_new++] = out;
        Py_INCREF(out);
        Py_INCREF(slot_obj);
        slots_val = slot_obj;
    }
    else if (ot == &PyLong_Type || out_spec == Py_None) {
        if (out_spec == Py_None)
            out = Py_None;
        else {
            Py_ssize_t ai = PyLong_AsSsize_t(out_spec);
            if (ai == -1 && PyErr_Occurred())
                goto notfast;
            if (ai < 0 || ai >= nargs)
                goto notfast_clean;
            out = PyTuple_GET_ITEM(args, ai); /* in place: the op returns that argument */
        }
        Py_INCREF(out);
        Py_INCREF(Py_None);
        slots_val = Py_None;
    }
    else if (ot == &PyTuple_Type || ot == &PyList_Type) {
        Py_ssize_t no = PySequence_Fast_GET_SIZE(out_spec);
        PyObject **os = PySequence_Fast_ITEMS(out_spec);
        if (no > MAX_OUTS)
            goto notfast_clean;
        Py_ssize_t k = 0;
        for (Py_ssize_t j = 0; j < no; j++) {
            PyObject *x = os[j];
            if ((PyObject *)Py_TYPE(x) == MetaT)
                k++;
            else if (x == Py_None)
                ;
            else if (PyLong_CheckExact(x)) {
                Py_ssize_t ai = PyLong_AsSsize_t(x);
                if (ai < 0 || ai >= nargs) {
                    if (ai == -1 && PyErr_Occurred())
                        goto notfast;
                    goto notfast_clean;
                }
            }
            else
                goto notfast_clean; /* nested: Python */
        }
        if (slots + k > c.n_slots_list)
            goto notfast_clean;
        PyObject *ol = PyList_New(no), *sl = PyList_New(no);
        if (ol == NULL || sl == NULL) {
            Py_XDECREF(ol);
            Py_XDECREF(sl);
            goto notfast;
        }
        Py_ssize_t s = slots;
        for (Py_ssize_t j = 0; j < no; j++) {
            PyObject *x = os[j], *w, *si;
            if ((PyObject *)Py_TYPE(x) == MetaT) {
                si = PyLong_FromSsize_t(s++);
                w = si ? make_lazy(tr, x, si) : NULL;
                if (w == NULL) {
                    Py_XDECREF(si);
                    Py_DECREF(ol);
                    Py_DECREF(sl);
                    goto notfast;
                }
                news[n_new++] = w;
                Py_INCREF(w);
            }
            else {
                w = x == Py_None ? Py_None : PyTuple_GET_ITEM(args, PyLong_AsSsize_t(x));
                Py_INCREF(w);
                si = Py_None;
                Py_INCREF(si);
            }
            PyList_SET_ITEM(ol, j, w);
            PyList_SET_ITEM(sl, j, si);
        }
        if (ot == &PyTuple_Type) {
            out = PyList_AsTuple(ol);
            slots_val = PyList_AsTuple(sl);
            Py_DECREF(ol);
            Py_DECREF(sl);
            if (out == NULL || slots_val == NULL)
                goto notfast;
        }
        else {
            out = ol;
            slots_val = sl;
        }
    }
    else
        goto notfast_clean;
    for (int q = 0; q < n_new; q++) {
        newrefs[q] = PyWeakref_NewRef(news[q], NULL);
        if (newrefs[q] == NULL)
            goto notfast;
        n_refs++;
    }

    okw = kw_marked != NULL ? kw_marked : (nkw ? kwargs : NO_KWARGS);
    entry = PyTuple_Pack(4, func, margs, okw, slots_val);
    n_op_obj = PyLong_FromSsize_t(n_op);
    PyObject *next_slots = n_new ? PyLong_FromSsize_t(slots + n_new) : NULL;
    if (entry == NULL || n_op_obj == NULL || (n_new && next_slots == NULL)) {
        Py_XDECREF(next_slots);
        goto notfast;
    }

    for (int q = 0; q < c.n_pending; q++)
        if (c.pending[q] >= PyList_GET_SIZE(last)) {
            Py_XDECREF(next_slots);
            goto notfast_clean;
        }
    if (c.n_nx && (PyList_GET_SIZE(c.ext) != c.n_ext0 || PyDict_GET_SIZE(c.groups) != c.n_groups0)) {
        Py_XDECREF(next_slots);
        goto notfast_clean; /* numbered meanwhile (Python code run by a check): Python */
    }

    /* ---- commit: the changes Engine.record makes, in its order ---- */
    for (int k = 0; k < c.n_nx; k++) { /* Trace.register's, in the order of first use */
        NewExt *e = &c.nx[k];
        PyObject *id = PyLong_FromVoidPtr(e->t), *idx = PyLong_FromSsize_t(c.n_ext0 + k);
        int err = id == NULL || idx == NULL ||
                  (e->owner != NULL && PyObject_SetAttr(e->owner, s_shared, Py_True) < 0) ||
                  (e->new_group && PyDict_SetItem(c.groups, e->addr, e->group) < 0) ||
                  PyDict_SetItem(c.ext_ids, id, idx) < 0 || PyList_Append(c.ext, e->t) < 0;
        Py_XDECREF(id);
        Py_XDECREF(idx);
        if (err) {
            Py_XDECREF(next_slots);
            goto failed;
        }
    }
    {
        PyObject *scal = GET(tr, scalars);
        int err = scal == NULL || !PyList_CheckExact(scal);
        for (int q = 0; q < c.n_pending && !err; q++) {
            Py_INCREF(n_op_obj);
            if (PyList_SetItem(last, c.pending[q], n_op_obj) < 0)
                err = 1;
        }
        for (int q = 0; q < c.n_scalars && !err; q++)
            if (PyList_Append(scal, c.scalars[q]) < 0)
                err = 1;
        Py_XDECREF(scal);
        if (sym_state != NULL && !err) /* shapes.step: state.outs, state.keys, M.sym_ops */
            err = PyList_Append(sym_outs, out_spec) < 0 || PyList_Append(sym_keys, key) < 0 ||
                  bump(s_sym_ops, &f_sym_ops) < 0;
        if (err || SET(tr, node, child) < 0) {
            Py_XDECREF(next_slots);
            goto failed;
        }
    }
    if (n_new) {
        PyObject *refs = GET(tr, refs);
        PyObject *m1 = PyLong_FromLong(-1);
        int err = refs == NULL || m1 == NULL ||
                  SET(tr, n_slots, next_slots) < 0;
        for (int q = 0; q < n_new && !err; q++)
            err = PyList_Append(refs, newrefs[q]) < 0 || PyList_Append(last, m1) < 0;
        Py_XDECREF(refs);
        Py_XDECREF(m1);
        Py_DECREF(next_slots);
        if (err)
            goto failed;
    }
    if (PyList_Append(ops, entry) < 0 || bump(s_ops_deferred, &f_ops_deferred) < 0 || bump(s_ops_intercepted, &f_ops_intercepted) < 0)
        goto failed;
    busy_set = 0;
    if (eset(eng, ed, s_busy, Py_False) < 0)
        goto failed;
    n_fast++;
    n_ext += c.n_nx;
    if (sym_state != NULL)
        n_sym++;
    ctx_clear(&c);
    Py_XDECREF(sym_state);
    Py_XDECREF(sym_outs);
    Py_XDECREF(sym_keys);
    Py_DECREF(spec);
    Py_DECREF(eng);
    Py_XDECREF(ed);
    Py_DECREF(tr);
    Py_DECREF(key);
    Py_DECREF(margs);
    Py_DECREF(ops);
    Py_DECREF(last);
    Py_DECREF(node);
    Py_DECREF(children);
    Py_DECREF(child);
    Py_DECREF(out_spec);
    Py_DECREF(entry);
    Py_DECREF(slots_val);
    Py_XDECREF(slot_obj);
    Py_DECREF(n_op_obj);
    Py_DECREF(writes);
    Py_XDECREF(kw_marked);
    for (int q = 0; q < n_new; q++)
        Py_DECREF(news[q]);
    for (int q = 0; q < n_refs; q++)
        Py_DECREF(newrefs[q]);
    return out;

failed: /* a change failed midway (out of memory): raise */
    n_fault++;
raise: /* also an error that is not an Exception (KeyboardInterrupt): the user's */
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (busy_set && eset(eng, ed, s_busy, Py_False) < 0)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        busy_set = 0;
    }
    goto cleanup;
handed: /* hand_off's answer: the op's result or its method's error; else (nothing done)
         * the Python path */
    if (was_handed) {
        Py_DECREF(spec);
        return out;
    }
    goto notfast;
notfast_maybe_err:
    if (PyErr_Occurred() && note_error() < 0)
        goto raise;
    goto notfast_clean;
notfast:
    if (PyErr_Occurred() && note_error() < 0)
        goto raise;
notfast_clean:
    if (busy_set && eset(eng, ed, s_busy, Py_False) < 0)
        PyErr_Clear();
cleanup:
    ctx_clear(&c);
    Py_XDECREF(sym_state);
    Py_XDECREF(sym_outs);
    Py_XDECREF(sym_keys);
    Py_XDECREF(spec);
    Py_XDECREF(eng);
    Py_XDECREF(ed);
    Py_XDECREF(tr);
    Py_XDECREF(tmp);
    Py_XDECREF(key);
    Py_XDECREF(margs);
    Py_XDECREF(ops);
    Py_XDECREF(last);
    Py_XDECREF(node);
    Py_XDECREF(children);
    Py_XDECREF(child);
    Py_XDECREF(out_spec);
    Py_XDECREF(out);
    Py_XDECREF(entry);
    Py_XDECREF(slot_obj);
    Py_XDECREF(n_op_obj);
    Py_XDECREF(writes);
    Py_XDECREF(kw_marked);
    Py_XDECREF(slots_val);
    for (int q = 0; q < n_new; q++)
        Py_DECREF(news[q]);
    for (int q = 0; q < n_refs; q++)
        Py_DECREF(newrefs[q]);
    return NULL;
}

/* dispatch(mode, func, types, args=(), kwargs=None): the mode's __torch_dispatch__ */
static PyObject *
hot_dispatch(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (ready && kwnames == NULL && (n == 4 || n == 5)) {
        PyObject *r = fast(av[0], av[1], av[2], av[3], n == 5 ? av[4] : Py_None);
        if (r != NULL || PyErr_Occurred())
            return r;
    }
    if (fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "adaptive_eager._hot: init() was not called");
        return NULL;
    }
    n_slow++;
    return PyObject_Vectorcall(fallback, av, n, kwnames);
}

static PyObject *
hot_init(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t n)
{
    if (n != 16 && n != 18) {
        PyErr_SetString(PyExc_TypeError,
                        "init(LazyTensor, Tensor, Parameter, Meta, SLOTS, make_wrapper, "
                        "set_bits, METRICS, NO_KWARGS, TO_COPY, DEFER, fallback, Trace, TrieNode, "
                        "OpSpec, Engine[, Template, SymTrace])");
        return NULL;
    }
    if (!PyType_Check(av[0]) || !PyType_Check(av[1]) || !PyType_Check(av[2]) ||
        !PyType_Check(av[3]) || !PyList_CheckExact(av[4]) || !PyDict_CheckExact(av[8]) ||
        !PyType_Check(av[12]) || !PyType_Check(av[13]) || !PyType_Check(av[14]) ||
        !PyType_Check(av[15]) || (n == 18 && (!PyType_Check(av[16]) || !PyType_Check(av[17])))) {
        PyErr_SetString(PyExc_TypeError, "init: unexpected argument types");
        return NULL;
    }
    PyObject **dst[12] = {&LazyT, &TensorT, &ParamT, &MetaT, &SLOTS, &make_wrapper, &set_bits,
                          &Mobj, &NO_KWARGS, &TO_COPY, &DEFER, &fallback};
    for (int i = 0; i < 12; i++) {
        Py_INCREF(av[i]);
        Py_XSETREF(*dst[i], av[i]);
    }
    fast_init(&f_ops, av[12], "ops");
    fast_init(&f_ext_ids, av[12], "ext_ids");
    fast_init(&f_last, av[12], "last");
    fast_init(&f_scalars, av[12], "scalars");
    fast_init(&f_node, av[12], "node");
    fast_init(&f_n_slots, av[12], "n_slots");
    fast_init(&f_refs, av[12], "refs");
    fast_init(&f_children, av[13], "children");
    fast_init(&f_out, av[13], "out");
    fast_init(&f_policy, av[14], "policy");
    fast_init(&f_view_arg, av[14], "view_arg");
    fast_init(&f_bool_index, av[14], "bool_index");
    fast_init(&f_structural, av[14], "structural");
    fast_init(&f_scalar_pos, av[14], "scalar_pos");
    fast_init(&f_scalar_kw, av[14], "scalar_kw");
    fast_init(&f_writes, av[14], "writes");
    fast_init(&f_wrapper_args, av[3], "wrapper_args");
    fast_init(&f_bits, av[3], "bits");
    fast_init(&f_mid, av[3], "mid");
    fast_init(&f_msize, av[3], "size");
    fast_init(&f_mstride, av[3], "stride");
    fast_init(&f_mdtype, av[3], "dtype");
    fast_init(&f_mdevice, av[3], "device");
    fast_init(&f_ext, av[12], "ext");
    fast_init(&f_groups, av[12], "groups");
    fast_init(&f_tr_engine, av[12], "engine");
    fast_init(&f_ops_intercepted, (PyObject *)Py_TYPE(av[7]), "ops_intercepted");
    fast_init(&f_ops_deferred, (PyObject *)Py_TYPE(av[7]), "ops_deferred");
    Py_INCREF(av[15]);
    Py_XSETREF(EngineT, av[15]);
    /* template steps (shapes.step's memo hit) only when given shapes' classes */
    fast_init(&f_tr_sym, av[12], "sym");
    fast_init(&f_node_sym, av[13], "sym");
    fast_init(&f_sym_ops, (PyObject *)Py_TYPE(av[7]), "sym_ops");
    if (n == 18) {
        fast_init(&f_tpl_dead, av[16], "dead");
        fast_init(&f_tpl_steps, av[16], "steps");
        fast_init(&f_tpl_nodes, av[16], "nodes");
        fast_init(&f_tpl_memo, av[16], "memo");
        fast_init(&f_st_tpl, av[17], "tpl");
        fast_init(&f_st_s, av[17], "s");
        fast_init(&f_st_outs, av[17], "outs");
        fast_init(&f_st_keys, av[17], "keys");
        Py_INCREF(av[16]);
        Py_XSETREF(TemplateT, av[16]);
        Py_INCREF(av[17]);
        Py_XSETREF(SymTraceT, av[17]);
    }
    else {
        Py_CLEAR(TemplateT);
        Py_CLEAR(SymTraceT);
    }
    ready = 1;
    Py_RETURN_NONE;
}

/* init_register(METAS, strided, untyped_storage, tf_mode_enabled, ESCAPED): core.meta._METAS
 * (intern_meta's dict, never rebound), torch.strided, torch._C.TensorBase.untyped_storage,
 * torch._C._is_torch_function_mode_enabled and outside.ESCAPED (never rebound): C then numbers
 * first uses of externals itself. */
static PyObject *
hot_init_register(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t n)
{
    if (n != 5 || !PyDict_CheckExact(av[0]) || !PyCallable_Check(av[2]) ||
        !PyCallable_Check(av[3]) || !PyDict_CheckExact(av[4])) {
        PyErr_SetString(PyExc_TypeError, "init_register(METAS: dict, strided, untyped_storage, "
                                         "tf_mode_enabled, ESCAPED: dict)");
        return NULL;
    }
    PyObject **dst[5] = {&METAS, &STRIDED, &storage_fn, &tf_mode_on, &ESCAPED};
    for (int i = 0; i < 5; i++) {
        Py_INCREF(av[i]);
        Py_XSETREF(*dst[i], av[i]);
    }
    Py_RETURN_NONE;
}

/* init_dropouts(dropouts, RANDOM): the attention ops mode.py defers when they draw nothing
 * ({OpSpec: position of dropout_p}, positions above 1) and opspec.RANDOM. */
static PyObject *
hot_init_dropouts(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t n)
{
    if (n != 2 || !PyDict_CheckExact(av[0])) {
        PyErr_SetString(PyExc_TypeError, "init_dropouts(dropouts: dict, RANDOM)");
        return NULL;
    }
    Py_INCREF(av[0]);
    Py_XSETREF(DROPOUTS, av[0]);
    Py_INCREF(av[1]);
    Py_XSETREF(RANDOM_P, av[1]);
    Py_RETURN_NONE;
}

/* Note [replay in C]
 * Op-by-op replay of a trace (execute.replay, Note [replay call plan] in execute.py) spends
 * about 8k instructions per op in its own Python loop around the aten call (add16 of
 * benchmarks/op_overhead.py): the argument list, the slot and lazy-tensor lookups, the call
 * through ``*ra``, the store, the release lookup. ``replay(ops, plan, env, drops, grad_ops)``
 * runs that loop in C for the plan's ``simple`` entries: the op's arguments go on a C array,
 * the positions the plan names are resolved there (a Slot marker: ``env[slot.i]``; a
 * LazyTensor: its ``_ae_real``), the op's C++ callable (``OpOverload._op``) is called with
 * vectorcall (kwargs, already free of tensors in a simple entry, as a dict), the result is
 * stored as ``execute._store`` stores it (an int slot; None; a tuple/list of those zipped with
 * a tuple/list result, nested; anything else through ``_store`` itself), and the slots that
 * ``drops[i]`` names are set to None. An entry that is not simple (a list holding slots or
 * lazy tensors, kwargs holding tensors), one in ``grad_ops`` (Note [grad-mode kernels]), or
 * one with more than MAX_REPLAY_ARGS arguments is run by ``execute._replay_one`` (the Python
 * loop's own body), then dropped by C as above. Signals are checked before every op (the
 * Python loop checks them between bytecodes), and an error raised at op i (by the op, a
 * store, or _replay_one) gets ``execute._note_replay_error``'s note, the Python path's, before
 * it propagates. The caller has entered ReplayGuard. ADAPTIVE_EAGER_ACCEL=0 runs the Python
 * loop; tests/test_replay_accel.py compares the two. */
static PyObject *R_SlotT, *R_LazyT, *R_one, *R_store, *R_note, *s_i;
static Fast f_slot_i;
static Py_ssize_t n_replayed = 0, n_replayed_py = 0;
#define MAX_REPLAY_ARGS 64

/* env[slots] = res as execute._store does. 0 ok, -1 error. */
static int
r_store(PyObject *slots, PyObject *res, PyObject *env)
{
    if (PyLong_CheckExact(slots)) {
        Py_ssize_t k = PyLong_AsSsize_t(slots);
        if (k >= 0 && k < PyList_GET_SIZE(env)) {
            PyObject *old = PyList_GET_ITEM(env, k);
            Py_INCREF(res);
            PyList_SET_ITEM(env, k, res);
            Py_XDECREF(old);
            return 0;
        }
        if (k == -1 && PyErr_Occurred())
            PyErr_Clear();
        return PyObject_SetItem(env, slots, res); /* what env[slots] = res does */
    }
    if (slots == Py_None)
        return 0;
    if ((PyTuple_CheckExact(slots) || PyList_CheckExact(slots)) &&
        (PyTuple_CheckExact(res) || PyList_CheckExact(res))) {
        Py_INCREF(slots);
        Py_INCREF(res);
        int rc = 0;
        /* zip: the shorter of the two (sizes re-read: a list may change under a store) */
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(slots) &&
                               k < PySequence_Fast_GET_SIZE(res); k++) {
            PyObject *s = PySequence_Fast_GET_ITEM(slots, k);
            if (s == Py_None)
                continue;
            PyObject *r = PySequence_Fast_GET_ITEM(res, k);
            Py_INCREF(s);
            Py_INCREF(r);
            rc = r_store(s, r, env);
            Py_DECREF(s);
            Py_DECREF(r);
            if (rc < 0)
                break;
        }
        Py_DECREF(slots);
        Py_DECREF(res);
        return rc;
    }
    PyObject *a[3] = {slots, res, env};
    PyObject *r = PyObject_Vectorcall(R_store, a, 3, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* env[s] = None for each slot of the tuple ``d``. 0 ok, -1 error. */
static int
r_drop(PyObject *d, PyObject *env)
{
    if (!PyTuple_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "replay: drops[i] must be None or a tuple of slots");
        return -1;
    }
    for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(d); q++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(d, q));
        if (s == -1 && PyErr_Occurred())
            return -1;
        if (s < 0 || s >= PyList_GET_SIZE(env)) {
            PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
            return -1;
        }
        PyObject *old = PyList_GET_ITEM(env, s);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(env, s, Py_None);
        Py_XDECREF(old);
    }
    return 0;
}

/* One simple entry: resolve the plan's positions, call, store. 0 ok, -1 error. */
static int
r_simple(PyObject *call, PyObject *pos, PyObject *args, PyObject *kwargs, PyObject *slots,
         PyObject *env)
{
    PyObject *stack[MAX_REPLAY_ARGS], *owned[MAX_REPLAY_ARGS];
    Py_ssize_t na = PyTuple_GET_SIZE(args), np = PyTuple_GET_SIZE(pos);
    int n_owned = 0, rc = -1;
    for (Py_ssize_t k = 0; k < na; k++)
        stack[k] = PyTuple_GET_ITEM(args, k); /* borrowed: the caller holds the op's entry */
    for (Py_ssize_t q = 0; q < np; q++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(pos, q));
        if (j < 0 || j >= na) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        PyObject *a = stack[j];
        if (Py_TYPE(a) == (PyTypeObject *)R_SlotT) {
            PyObject *iv = fget(a, s_i, &f_slot_i);
            if (iv == NULL)
                goto done;
            Py_ssize_t s = PyLong_AsSsize_t(iv);
            Py_DECREF(iv);
            if (s < 0 || s >= PyList_GET_SIZE(env)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "list index out of range");
                goto done;
            }
            stack[j] = PyList_GET_ITEM(env, s); /* borrowed: env changes only below */
        }
        else if (Py_TYPE(a) == (PyTypeObject *)R_LazyT) {
            PyObject *r = PyObject_GetAttr(a, s_ae_real);
            if (r == NULL)
                goto done;
            owned[n_owned++] = r;
            stack[j] = r;
        }
    }
    PyObject *res;
    if (kwargs != NULL && PyDict_CheckExact(kwargs) && PyDict_GET_SIZE(kwargs) > 0)
        res = PyObject_VectorcallDict(call, stack, na, kwargs);
    else
        res = PyObject_Vectorcall(call, stack, na, NULL);
    if (res == NULL)
        goto done;
    rc = r_store(slots, res, env);
    Py_DECREF(res);
done:
    for (int k = 0; k < n_owned; k++)
        Py_DECREF(owned[k]);
    return rc;
}

/* replay(ops, plan, env, drops, grad_ops): Note [replay in C] */
static PyObject *
hot_replay(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t n)
{
    if (n != 5 || !PyList_CheckExact(av[0]) || !PyList_CheckExact(av[1]) ||
        !PyList_CheckExact(av[2]) || !PyList_CheckExact(av[3]) ||
        (av[4] != Py_None && !PyDict_CheckExact(av[4]))) {
        PyErr_SetString(PyExc_TypeError, "replay(ops: list, plan: list, env: list, drops: list, "
                                         "grad_ops: dict | None)");
        return NULL;
    }
    if (R_one == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "adaptive_eager._hot: init_replay() was not called");
        return NULL;
    }
    PyObject *ops = av[0], *plan = av[1], *env = av[2], *drops = av[3], *grad_ops = av[4];
    if (grad_ops != Py_None && PyDict_GET_SIZE(grad_ops) == 0)
        grad_ops = Py_None;
    Py_ssize_t i = 0, n_ops = PyList_GET_SIZE(plan);
    if (PyList_GET_SIZE(ops) < n_ops || PyList_GET_SIZE(drops) < n_ops) {
        PyErr_SetString(PyExc_ValueError, "replay: ops and drops must cover the plan");
        return NULL;
    }
    for (; i < n_ops && i < PyList_GET_SIZE(plan) && i < PyList_GET_SIZE(ops) &&
           i < PyList_GET_SIZE(drops); i++) {
        if (PyErr_CheckSignals() < 0)
            goto fail;
        PyObject *p = PyList_GET_ITEM(plan, i), *item = PyList_GET_ITEM(ops, i);
        Py_INCREF(p);
        Py_INCREF(item);
        int slow = !PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) != 3 ||
                   !PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4 ||
                   PyTuple_GET_ITEM(p, 2) != Py_True ||
                   !PyTuple_CheckExact(PyTuple_GET_ITEM(p, 1)) ||
                   !PyTuple_CheckExact(PyTuple_GET_ITEM(item, 1)) ||
                   PyTuple_GET_SIZE(PyTuple_GET_ITEM(item, 1)) > MAX_REPLAY_ARGS ||
                   (PyTuple_GET_ITEM(item, 2) != NULL && !PyDict_CheckExact(PyTuple_GET_ITEM(item, 2)));
        int rc = 0;
        if (!slow && grad_ops != Py_None) {
            PyObject *key = PyLong_FromSsize_t(i);
            rc = key == NULL ? -1 : PyDict_Contains(grad_ops, key);
            Py_XDECREF(key);
            if (rc > 0)
                slow = 1;
        }
        if (rc >= 0) {
            if (slow) {
                n_replayed_py++;
                PyObject *idx = PyLong_FromSsize_t(i);
                rc = -1;
                if (idx != NULL) {
                    PyObject *a[5] = {ops, plan, av[4], idx, env};
                    PyObject *r = PyObject_Vectorcall(R_one, a, 5, NULL);
                    Py_DECREF(idx);
                    if (r != NULL) {
                        rc = 0;
                        Py_DECREF(r);
                    }
                }
            }
            else {
                n_replayed++;
                rc = r_simple(PyTuple_GET_ITEM(p, 0), PyTuple_GET_ITEM(p, 1),
                              PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2),
                              PyTuple_GET_ITEM(item, 3), env);
            }
        }
        Py_DECREF(p);
        Py_DECREF(item);
        if (rc < 0)
            goto fail;
        PyObject *d = PyList_GET_ITEM(drops, i);
        if (d != Py_None && r_drop(d, env) < 0)
            goto fail;
    }
    Py_RETURN_NONE;
fail: {
        /* the Python path's note (execute._note_replay_error: Exceptions only), then re-raise */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        if (tb != NULL && v != NULL)
            PyException_SetTraceback(v, tb);
        PyObject *idx = PyLong_FromSsize_t(i);
        if (idx != NULL && v != NULL) {
            PyObject *a[3] = {v, idx, ops};
            PyObject *r = PyObject_Vectorcall(R_note, a, 3, NULL);
            Py_XDECREF(r);
        }
        Py_XDECREF(idx);
        PyErr_Clear(); /* a failure of the note itself: the op's error is the one to raise */
        PyErr_Restore(t, v, tb);
        return NULL;
    }
}

/* init_replay(Slot, LazyTensor, replay_one, store, note): execute.py's objects (Note [replay
 * in C]) */
static PyObject *
hot_init_replay(PyObject *Py_UNUSED(module), PyObject *const *av, Py_ssize_t n)
{
    if (n != 5 || !PyType_Check(av[0]) || !PyType_Check(av[1]) || !PyCallable_Check(av[2]) ||
        !PyCallable_Check(av[3]) || !PyCallable_Check(av[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "init_replay(Slot: type, LazyTensor: type, replay_one, store, note)");
        return NULL;
    }
    PyObject **dst[5] = {&R_SlotT, &R_LazyT, &R_one, &R_store, &R_note};
    for (int k = 0; k < 5; k++) {
        Py_INCREF(av[k]);
        Py_XSETREF(*dst[k], av[k]);
    }
    fast_init(&f_slot_i, av[0], "i");
    Py_RETURN_NONE;
}

static PyObject *
hot_stats(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    Fast *fs[] = {&f_ops, &f_ext_ids, &f_last, &f_scalars, &f_node, &f_n_slots, &f_refs, &f_children, &f_out, &f_policy, &f_view_arg, &f_bool_index, &f_structural, &f_scalar_pos, &f_scalar_kw, &f_writes, &f_wrapper_args, &f_bits, &f_ops_intercepted, &f_ops_deferred,
                  &f_tr_sym, &f_node_sym, &f_st_tpl, &f_st_s, &f_st_outs, &f_st_keys, &f_tpl_dead, &f_tpl_steps, &f_tpl_nodes, &f_tpl_memo, &f_sym_ops,
                  &f_ext, &f_groups, &f_tr_engine, &f_mid, &f_msize, &f_mstride, &f_mdtype, &f_mdevice};
    Py_ssize_t direct = 0;
    for (size_t i = 0; i < sizeof(fs) / sizeof(fs[0]); i++)
        direct += fs[i]->t != NULL && fs[i]->off >= 0;
    return Py_BuildValue("{snsnsnsnsnsnsnsnsn}", "fast", n_fast, "slow", n_slow, "faults",
                         n_fault, "sym", n_sym, "ext", n_ext, "handed", n_handed, "direct_fields",
                         direct, "replayed", n_replayed, "replayed_py", n_replayed_py);
}

static PyObject *
hot_reset_stats(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    n_fast = n_slow = n_fault = n_sym = n_ext = n_handed = n_replayed = n_replayed_py = 0;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))hot_dispatch, METH_FASTCALL | METH_KEYWORDS,
     "dispatch(mode, func, types, args=(), kwargs=None): DeferMode.__torch_dispatch__, with the "
     "common case of recording an op on a known trace done in C (Note [C accelerator])."},
    {"init", (PyCFunction)(void (*)(void))hot_init, METH_FASTCALL,
     "init(LazyTensor, Tensor, Parameter, Meta, SLOTS, make_wrapper, set_bits, METRICS, "
     "NO_KWARGS, TO_COPY, DEFER, fallback, Trace, TrieNode, OpSpec, Engine[, Template, "
     "SymTrace]): the engine's objects, once (without shapes' classes template steps are "
     "left to Python)."},
    {"init_register", (PyCFunction)(void (*)(void))hot_init_register, METH_FASTCALL,
     "init_register(METAS, strided, untyped_storage, tf_mode_enabled, ESCAPED): core.meta._METAS, "
     "torch.strided, TensorBase.untyped_storage, torch._C._is_torch_function_mode_enabled, "
     "outside.ESCAPED; C "
     "then numbers first uses of external tensors as Trace.register does (without it, Python)."},
    {"init_dropouts", (PyCFunction)(void (*)(void))hot_init_dropouts, METH_FASTCALL,
     "init_dropouts(dropouts, RANDOM): {OpSpec: position of dropout_p} of the attention ops "
     "deferred when they draw nothing (Note [attention without dropout]), and opspec.RANDOM; "
     "C then records them (without it, Python)."},
    {"stats", hot_stats, METH_NOARGS,
     "Ops recorded in C (fast; sym: of those, template steps; ext: first uses of external "
     "tensors numbered in C), handed to the Python path (slow; handed: of those, views of real "
     "tensors and host-scalar ops handed straight to the engine's method), errors met while "
     "checking (faults: the Python path then ran the op), __slots__ fields read at their "
     "offsets; replayed: ops replay's C loop ran, replayed_py: those it handed to "
     "execute._replay_one (Note [replay in C])."},
    {"replay", (PyCFunction)(void (*)(void))hot_replay, METH_FASTCALL,
     "replay(ops, plan, env, drops, grad_ops): run a trace's ops in order into env (Note "
     "[replay in C]); drops[i]: None or the tuple of slots to set to None after op i."},
    {"init_replay", (PyCFunction)(void (*)(void))hot_init_replay, METH_FASTCALL,
     "init_replay(Slot, LazyTensor, replay_one, store, note): execute.py's objects, once."},
    {"reset_stats", hot_reset_stats, METH_NOARGS, "Zero the counters of stats()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "adaptive_eager._hot",
    "The engine's per-op hot path in C (Note [C accelerator] in _hot.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

#define INTERN(var, text)                                                                    \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                    \
        return NULL;

PyMODINIT_FUNC
PyInit__hot(void)
{
    if ((ONE = PyLong_FromLong(1)) == NULL || (ZERO = PyLong_FromLong(0)) == NULL)
        return NULL;
    if ((BOOL_KEYS[0] = PyTuple_Pack(2, (PyObject *)&PyBool_Type, Py_False)) == NULL ||
        (BOOL_KEYS[1] = PyTuple_Pack(2, (PyObject *)&PyBool_Type, Py_True)) == NULL)
        return NULL;
    INTERN(s_ae_spec, "_ae_spec");
    INTERN(s_policy, "policy");
    INTERN(s_view_arg, "view_arg");
    INTERN(s_engine, "engine");
    INTERN(s_trace, "trace");
    INTERN(s_busy, "busy");
    INTERN(s_foreign, "foreign");
    INTERN(s_ops, "ops");
    INTERN(s_ext_ids, "ext_ids");
    INTERN(s_last, "last");
    INTERN(s_scalars, "scalars");
    INTERN(s_node, "node");
    INTERN(s_children, "children");
    INTERN(s_out, "out");
    INTERN(s_n_slots, "n_slots");
    INTERN(s_refs, "refs");
    INTERN(s_ae_trace, "_ae_trace");
    INTERN(s_ae_real, "_ae_real");
    INTERN(s_ae_slot, "_ae_slot");
    INTERN(s_ae_meta, "_ae_meta");
    INTERN(s_wrapper_args, "wrapper_args");
    INTERN(s_bits, "bits");
    INTERN(s_structural, "structural");
    INTERN(s_scalar_pos, "scalar_pos");
    INTERN(s_scalar_kw, "scalar_kw");
    INTERN(s_writes, "writes");
    INTERN(s_ext_writes, "ext_writes");
    INTERN(s_cap, "cap");
    INTERN(s_bool_index, "bool_index");
    INTERN(s_ops_intercepted, "ops_intercepted");
    INTERN(s_ops_deferred, "ops_deferred");
    INTERN(s_sym, "sym");
    INTERN(s_tpl, "tpl");
    INTERN(s_s, "s");
    INTERN(s_outs, "outs");
    INTERN(s_keys, "keys");
    INTERN(s_dead, "dead");
    INTERN(s_steps, "steps");
    INTERN(s_nodes, "nodes");
    INTERN(s_memo, "memo");
    INTERN(s_sym_ops, "sym_ops");
    INTERN(s_x, "x");
    INTERN(s_ext, "ext");
    INTERN(s_groups, "groups");
    INTERN(s_shared, "shared");
    INTERN(s_mid, "mid");
    INTERN(s_size, "size");
    INTERN(s_stride, "stride");
    INTERN(s_dtype, "dtype");
    INTERN(s_device, "device");
    INTERN(s_layout, "layout");
    INTERN(s_is_quantized, "is_quantized");
    INTERN(s_is_nested, "is_nested");
    INTERN(s_type, "type");
    INTERN(s_is_conj, "is_conj");
    INTERN(s_is_neg, "is_neg");
    INTERN(s_shape, "shape");
    INTERN(s_storage_offset, "storage_offset");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_numel, "numel");
    INTERN(s_run_view, "run_view");
    INTERN(s_run_host_scalar, "run_host_scalar");
    INTERN(s_dropout_p, "dropout_p");
    INTERN(s_p, "p");
    INTERN(s_i, "i");
    return PyModule_Create(&module_def);
}

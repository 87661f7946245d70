/* benchmarks/op_overhead's wrapper floor, CPython API only (built by the benchmark at run time).
 *
 * ``handler(mode, func, types, args, kwargs)`` is installed as a TorchDispatchMode's
 * ``__torch_dispatch__`` (a bound builtin: torch calls C with no Python frame, as the engine's
 * accelerator is called). It does only what any engine that hands out one wrapper tensor per
 * op must do: make the wrapper (``_make_wrapper_subclass`` with fixed metadata), set three
 * attributes on it and keep a weak reference to it. No key, no trie, no trace. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *make = NULL, *wargs = NULL, *refs = NULL, *names[3], *values[3];

static PyObject *
handler(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *t = PyObject_Call(make, wargs, NULL);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < 3; i++)
        if (PyObject_SetAttr(t, names[i], values[i]) < 0) {
            Py_DECREF(t);
            return NULL;
        }
    PyObject *w = PyWeakref_NewRef(t, NULL);
    if (w == NULL || PyList_Append(refs, w) < 0) {
        Py_XDECREF(w);
        Py_DECREF(t);
        return NULL;
    }
    Py_DECREF(w);
    if (PyList_GET_SIZE(refs) >= 4096 && PyList_SetSlice(refs, 0, PyList_GET_SIZE(refs), NULL) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

/* setup(make_wrapper, wrapper_args, refs, (name, name, name), (value, value, value)) */
static PyObject *
setup(PyObject *self, PyObject *args)
{
    PyObject *n, *v;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!", &make, &PyTuple_Type, &wargs, &PyList_Type, &refs,
                          &PyTuple_Type, &n, &PyTuple_Type, &v))
        return NULL;
    if (PyTuple_GET_SIZE(n) != 3 || PyTuple_GET_SIZE(v) != 3) {
        PyErr_SetString(PyExc_ValueError, "three names and three values");
        return NULL;
    }
    Py_INCREF(make);
    Py_INCREF(wargs);
    Py_INCREF(refs);
    for (int i = 0; i < 3; i++) {
        names[i] = PyTuple_GET_ITEM(n, i);
        values[i] = PyTuple_GET_ITEM(v, i);
        Py_INCREF(names[i]);
        Py_INCREF(values[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"handler", (PyCFunction)(void (*)(void))handler, METH_FASTCALL, "a dispatch handler"},
    {"setup", setup, METH_VARARGS, "the wrapper's maker, arguments and attributes"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_floor", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__floor(void)
{
    return PyModule_Create(&module);
}

/* The pool index's order of groups, least recently used first: a doubly linked list over slots, a Python type.
 *
 * Each group the index holds has a slot (a small int, kvpool/core/pool/lru.py). An order keeps, per slot, its
 * neighbours in two int32 arrays: moving a group to either end is a few stores, not a hash lookup and a relink in
 * an ordered dict whose entries lie all over memory (a lookup touches a whole history: 450 groups, one call). A
 * Python type, not a plain library called through ctypes: a call costs tens of nanoseconds, not a microsecond,
 * and a save adds and evicts a group per chunk.
 *
 * prev[s] == OUT: slot s is not in the order; END marks either end. Every method checks its slots against the
 * capacity and membership, so a wrong call raises, never writes out of bounds.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define END (-1)
#define OUT (-2)

typedef struct {
    PyObject_HEAD
    int32_t *prev;
    int32_t *next;
    Py_ssize_t capacity;
    Py_ssize_t count;
    int32_t head;
    int32_t tail;
} Order;

static PyTypeObject OrderType;

static int valid(const Order *o, Py_ssize_t s) { return s >= 0 && s < o->capacity; }

static int member(const Order *o, Py_ssize_t s) { return valid(o, s) && o->prev[s] != OUT; }

static int grow_to(Order *o, Py_ssize_t capacity) {
    if (capacity <= o->capacity) return 0;
    if (capacity > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an order holds at most 2**31 - 1 slots");
        return -1;
    }
    int32_t *prev = PyMem_Realloc(o->prev, (size_t)capacity * sizeof(int32_t));
    if (prev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->prev = prev;
    int32_t *next = PyMem_Realloc(o->next, (size_t)capacity * sizeof(int32_t));
    if (next == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->next = next;
    for (Py_ssize_t s = o->capacity; s < capacity; s++) prev[s] = next[s] = OUT;
    o->capacity = capacity;
    return 0;
}

static void unlink_slot(Order *o, int32_t s) {
    int32_t p = o->prev[s], n = o->next[s];
    if (p == END) o->head = n; else o->next[p] = n;
    if (n == END) o->tail = p; else o->prev[n] = p;
}

static void link_back(Order *o, int32_t s) {
    o->prev[s] = o->tail;
    o->next[s] = END;
    if (o->tail == END) o->head = s; else o->next[o->tail] = s;
    o->tail = s;
}

static void link_front(Order *o, int32_t s) {
    o->next[s] = o->head;
    o->prev[s] = END;
    if (o->head == END) o->tail = s; else o->prev[o->head] = s;
    o->head = s;
}

static int Order_init(Order *o, PyObject *args, PyObject *kwds) {
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", names, &capacity)) return -1;
    if (o->prev != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an order is made once");
        return -1;
    }
    o->head = o->tail = END;
    o->count = 0;
    return grow_to(o, capacity > 0 ? capacity : 1);
}

static void Order_dealloc(Order *o) {
    PyMem_Free(o->prev);
    PyMem_Free(o->next);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static Py_ssize_t Order_len(Order *o) { return o->count; }

static int Order_contains(Order *o, PyObject *value) {
    Py_ssize_t s = PyLong_AsSsize_t(value);
    if (s == -1 && PyErr_Occurred()) return -1;
    return member(o, s);
}

static PyObject *Order_grow(Order *o, PyObject *arg) {
    Py_ssize_t capacity = PyLong_AsSsize_t(arg);
    if (capacity == -1 && PyErr_Occurred()) return NULL;
    if (grow_to(o, capacity) != 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Order_push_back(Order *o, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (!valid(o, s) || member(o, s)) {
        PyErr_Format(PyExc_ValueError, "slot %zd is out of range or already in the order", s);
        return NULL;
    }
    link_back(o, (int32_t)s);
    o->count++;
    Py_RETURN_NONE;
}

static PyObject *Order_remove(Order *o, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (!member(o, s)) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not in the order", s);
        return NULL;
    }
    unlink_slot(o, (int32_t)s);
    o->prev[s] = o->next[s] = OUT;
    o->count--;
    Py_RETURN_NONE;
}

/* ``slots``: a buffer of C ints (array("i")). */
static int get_slots(PyObject *arg, Py_buffer *view) {
    if (PyObject_GetBuffer(arg, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return -1;
    if (view->itemsize != sizeof(int32_t) || view->format == NULL || strcmp(view->format, "i") != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "slots are a list or tuple of ints, or an array('i')");
        return -1;
    }
    return 0;
}

static void move_slot(Order *o, Py_ssize_t s, int to_back, Py_ssize_t *moved) {
    if (!member(o, s)) return;
    (*moved)++;
    if ((to_back ? o->tail : o->head) == s) return;
    unlink_slot(o, (int32_t)s);
    if (to_back) link_back(o, (int32_t)s); else link_front(o, (int32_t)s);
}

/* Each slot of ``slots`` that is in the order moved to one end: to the back from the last to the first (the first
 * named ends the most recently used: an ordered dict's move_to_end over the reversed list), or to the front from
 * the first to the last (the last named ends the least recently used). Returns how many moved. ``slots``: a list
 * or tuple of ints (checked whole before anything moves: an int too large for a slot is in no order) or an
 * array('i'). */
static PyObject *move(Order *o, PyObject *arg, int to_back) {
    Py_ssize_t moved = 0;
    if (PyList_Check(arg) || PyTuple_Check(arg)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(arg);
        PyObject **items = PySequence_Fast_ITEMS(arg);
        for (Py_ssize_t k = 0; k < n; k++) {
            if (!PyLong_Check(items[k])) {
                PyErr_Format(PyExc_TypeError, "slots[%zd] is not an int", k);
                return NULL;
            }
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            int overflow;
            long long s = PyLong_AsLongLongAndOverflow(items[to_back ? n - 1 - k : k], &overflow);
            if (s == -1 && PyErr_Occurred()) return NULL;
            if (overflow == 0) move_slot(o, (Py_ssize_t)s, to_back, &moved);
        }
        return PyLong_FromSsize_t(moved);
    }
    Py_buffer view;
    if (get_slots(arg, &view) != 0) return NULL;
    const int32_t *slots = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int32_t);
    for (Py_ssize_t k = 0; k < n; k++) move_slot(o, slots[to_back ? n - 1 - k : k], to_back, &moved);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(moved);
}

static PyObject *Order_touch(Order *o, PyObject *arg) { return move(o, arg, 1); }

static PyObject *Order_demote(Order *o, PyObject *arg) { return move(o, arg, 0); }

/* The first slot, or -1 when the order is empty. */
static PyObject *Order_first(Order *o, PyObject *unused) { return PyLong_FromLong(o->head); }

/* The slot after ``slot``, or -1 after the last; RuntimeError when ``slot`` is not in the order (it left since
 * the caller read it: the order changed under an iteration). */
static PyObject *Order_after(Order *o, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (!member(o, s)) {
        PyErr_SetString(PyExc_RuntimeError, "the order changed during an iteration over it");
        return NULL;
    }
    return PyLong_FromLong(o->next[s]);
}

/* ``other`` (an empty order at least as large) gets this order's slots in this order. */
static PyObject *Order_copy_into(Order *o, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &OrderType)) {
        PyErr_SetString(PyExc_ValueError, "an order is copied into an empty native order at least as large");
        return NULL;
    }
    Order *dst = (Order *)arg;
    if (dst->count != 0 || dst->capacity < o->capacity) {
        PyErr_SetString(PyExc_ValueError, "an order is copied into an empty native order at least as large");
        return NULL;
    }
    for (int32_t s = o->head; s != END; s = o->next[s]) link_back(dst, s);
    dst->count = o->count;
    Py_RETURN_NONE;
}

static PyMethodDef Order_methods[] = {
    {"grow", (PyCFunction)Order_grow, METH_O, "Make room for slots below the given capacity (never shrinks)."},
    {"push_back", (PyCFunction)Order_push_back, METH_O, "A slot not in the order becomes its last."},
    {"remove", (PyCFunction)Order_remove, METH_O, "Take a slot out of the order."},
    {"touch", (PyCFunction)Order_touch, METH_O, "Move slots to the back, the first named last."},
    {"demote", (PyCFunction)Order_demote, METH_O, "Move slots to the front, the last named first."},
    {"first", (PyCFunction)Order_first, METH_NOARGS, "The first slot, or -1."},
    {"after", (PyCFunction)Order_after, METH_O, "The slot after a slot in the order, or -1."},
    {"copy_into", (PyCFunction)Order_copy_into, METH_O, "Copy this order into an empty one."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Order_as_sequence = {
    .sq_length = (lenfunc)Order_len,
    .sq_contains = (objobjproc)Order_contains,
};

static PyTypeObject OrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool_lru.Order",
    .tp_doc = "Slots in order, least recently used first (kvpool/core/pool/lru.py).",
    .tp_basicsize = sizeof(Order),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Order_init,
    .tp_dealloc = (destructor)Order_dealloc,
    .tp_methods = Order_methods,
    .tp_as_sequence = &Order_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool_lru", "The pool index's order of groups (kvpool/core/pool/lru.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit_kvpool_lru(void) {
    if (PyType_Ready(&OrderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&OrderType);
    if (PyModule_AddObject(m, "Order", (PyObject *)&OrderType) < 0) {
        Py_DECREF(&OrderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

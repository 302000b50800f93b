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
 *
 * The module also holds passes over group records' fields (below; kvpool/core/pool/fields.py).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

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

/* ---- passes over records' fields ---------------------------------------------------------------------------
 *
 * A lookup reads one field of each group of a whole history several times (ready, slot, its kept encoding) and a
 * lease counts each group up and down: each a Python step per group (a map, an attribute getter, a loop), most of
 * a long lookup's cost. These read and write a ``__slots__`` field of every record of a list in one C loop, at the
 * offset its member descriptor names, as the interpreter's own specialised attribute access does. Every record
 * must be an instance of the class named (or a subclass: same offsets), else TypeError; a field never set raises
 * AttributeError, as reading it would; a write is refused where the class has its own ``__setattr__`` (a frozen
 * dataclass). Nothing is written unless every record passed its checks. */

typedef struct {
    PyTypeObject *cls;
    Py_ssize_t offset;
    PyObject *name;
} Field;

/* The slot field ``name`` of ``cls``: a writable object member (``__slots__``, a slots dataclass). */
static int field_of(PyObject *cls, PyObject *name, int writing, Field *f) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "cls must be a class");
        return -1;
    }
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "name must be a str");
        return -1;
    }
    PyObject *descr = PyObject_GetAttr(cls, name);
    if (descr == NULL) return -1;
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type)
             && PyType_IsSubtype((PyTypeObject *)cls, PyDescr_TYPE(descr))
             && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX
             && !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
    if (ok) f->offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s.%U is not a writable __slots__ field", ((PyTypeObject *)cls)->tp_name,
                     name);
        return -1;
    }
    if (writing && ((PyTypeObject *)cls)->tp_setattro != PyObject_GenericSetAttr) {
        PyErr_Format(PyExc_TypeError, "%s sets its attributes its own way: its fields are not written here",
                     ((PyTypeObject *)cls)->tp_name);
        return -1;
    }
    f->cls = (PyTypeObject *)cls;
    f->name = name;
    return 0;
}

/* Record ``k``'s field (borrowed), or NULL with an error set. */
static PyObject *field_at(const Field *f, PyObject *item, Py_ssize_t k) {
    if (!Py_IS_TYPE(item, f->cls) && !PyType_IsSubtype(Py_TYPE(item), f->cls)) {
        PyErr_Format(PyExc_TypeError, "items[%zd] is a %s, not a %s", k, Py_TYPE(item)->tp_name, f->cls->tp_name);
        return NULL;
    }
    PyObject *value = *(PyObject **)((char *)item + f->offset);
    if (value == NULL) PyErr_Format(PyExc_AttributeError, "items[%zd] has no %U", k, f->name);
    return value;
}

/* A pass's arguments (items, cls, name[, delta]): the field, and the items as a list or tuple (a new reference). */
static int parse(PyObject *args, const char *fmt, Field *f, int writing, PyObject **fast, long long *delta) {
    PyObject *seq, *cls, *name;
    if (delta != NULL ? !PyArg_ParseTuple(args, fmt, &seq, &cls, &name, delta)
                      : !PyArg_ParseTuple(args, fmt, &seq, &cls, &name))
        return -1;
    if (field_of(cls, name, writing, f) != 0) return -1;
    *fast = PySequence_Fast(seq, "items must be a list or a tuple");
    return *fast == NULL ? -1 : 0;
}

/* How many items have the field True: all of them (``count``), or the leading run (``leading``: None, a missing
 * record, or any other value ends it). */
static PyObject *count_true(PyObject *args, int leading) {
    PyObject *fast;
    Field f;
    if (parse(args, "OOU", &f, 0, &fast, NULL) != 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), count = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (leading && items[k] == Py_None) break;
        PyObject *value = field_at(&f, items[k], k);
        if (value == NULL) {
            Py_DECREF(fast);
            return NULL;
        }
        if (value == Py_True) count++;
        else if (leading) break;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(count);
}

/* leading(items, cls, name): how many leading items have the field True. */
static PyObject *fields_leading(PyObject *unused, PyObject *args) { return count_true(args, 1); }

/* count(items, cls, name): how many items have the field True. */
static PyObject *fields_count(PyObject *unused, PyObject *args) { return count_true(args, 0); }

/* values(items, cls, name): a list of the items' fields. */
static PyObject *fields_values(PyObject *unused, PyObject *args) {
    PyObject *fast;
    Field f;
    if (parse(args, "OOU", &f, 0, &fast, NULL) != 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *value = field_at(&f, items[k], k);
        if (value == NULL) {
            Py_DECREF(out);
            Py_DECREF(fast);
            return NULL;
        }
        PyList_SET_ITEM(out, k, Py_NewRef(value));
    }
    Py_DECREF(fast);
    return out;
}

/* add(items, cls, name, delta): each item's int field grows by ``delta`` (an item named twice, twice); checked
 * whole first (each an int, each sum within 64 bits), so an error leaves every field as it was. */
static PyObject *fields_add(PyObject *unused, PyObject *args) {
    PyObject *fast;
    Field f;
    long long delta;
    if (parse(args, "OOUL", &f, 1, &fast, &delta) != 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *value = field_at(&f, items[k], k);
        if (value == NULL) goto fail;
        if (Py_TYPE(items[k])->tp_setattro != PyObject_GenericSetAttr) {
            PyErr_Format(PyExc_TypeError, "items[%zd], a %s, sets its attributes its own way", k,
                         Py_TYPE(items[k])->tp_name);
            goto fail;
        }
        if (!PyLong_CheckExact(value)) {
            PyErr_Format(PyExc_TypeError, "items[%zd].%U is not an int", k, f.name);
            goto fail;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred()) goto fail;
        /* room for n more steps of delta whatever repeats: |delta| * n bounded by 2**62 */
        if (overflow || v > (1LL << 62) || v < -(1LL << 62) || delta > (1LL << 30) || delta < -(1LL << 30)
            || n > (1LL << 30)) {
            PyErr_Format(PyExc_OverflowError, "items[%zd].%U %+lld is out of range", k, f.name, delta);
            goto fail;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject **slot = (PyObject **)((char *)items[k] + f.offset);
        PyObject *sum = PyLong_FromLongLong(PyLong_AsLongLong(*slot) + delta);
        if (sum == NULL) goto fail; /* (no memory: the items before k are added) */
        PyObject *old = *slot;
        *slot = sum;
        Py_DECREF(old);
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    return NULL;
}

/* join_pairs(pairs): for (bytes, tuple) pairs, their bytes joined and the set of what their tuples hold (a tuple
 * that is the one before it, the same object, is not read again). The pairs are read from a tuple of their own:
 * adding to the set hashes what the tuples hold, which may run Python code that changes a list it was given. */
static PyObject *fields_join_pairs(PyObject *unused, PyObject *arg) {
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "pairs must be a list or a tuple");
        return NULL;
    }
    PyObject *fast = PySequence_Tuple(arg);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast), total = 0;
    PyObject **items = &PyTuple_GET_ITEM(fast, 0);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = items[k];
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 0))
            || !PyTuple_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_Format(PyExc_TypeError, "pairs[%zd] is not a (bytes, tuple) pair", k);
            Py_DECREF(fast);
            return NULL;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 0));
        if (size > PY_SSIZE_T_MAX - total) {
            PyErr_SetString(PyExc_OverflowError, "the joined bytes would be too long");
            Py_DECREF(fast);
            return NULL;
        }
        total += size;
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, total);
    PyObject *named = PySet_New(NULL);
    if (joined == NULL || named == NULL) goto fail;
    char *out = PyBytes_AS_STRING(joined);
    PyObject *last = NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *first = PyTuple_GET_ITEM(items[k], 0), *second = PyTuple_GET_ITEM(items[k], 1);
        memcpy(out, PyBytes_AS_STRING(first), (size_t)PyBytes_GET_SIZE(first));
        out += PyBytes_GET_SIZE(first);
        if (second == last) continue;
        last = second;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(second); j++)
            if (PySet_Add(named, PyTuple_GET_ITEM(second, j)) != 0) goto fail;
    }
    Py_DECREF(fast);
    PyObject *result = PyTuple_Pack(2, joined, named);
    Py_DECREF(joined);
    Py_DECREF(named);
    return result;
fail:
    Py_XDECREF(joined);
    Py_XDECREF(named);
    Py_DECREF(fast);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"leading", fields_leading, METH_VARARGS, "leading(items, cls, name): how many leading items' field is True."},
    {"count", fields_count, METH_VARARGS, "count(items, cls, name): how many items' field is True."},
    {"values", fields_values, METH_VARARGS, "values(items, cls, name): the items' fields, a list."},
    {"add", fields_add, METH_VARARGS, "add(items, cls, name, delta): each item's int field grows by delta."},
    {"join_pairs", fields_join_pairs, METH_O,
     "join_pairs(pairs): (bytes, tuple) pairs' bytes joined, and the set of their tuples' items."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool_lru",
    "The pool index's order of groups and passes over group records (kvpool/core/pool/lru.py, fields.py).", -1,
    module_methods,
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

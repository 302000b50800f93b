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
 * The module also holds passes over group records' fields (kvpool/core/pool/fields.py) and a segment's allocator
 * (kvpool/core/pool/allocator.py), below.
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

/* ---- a segment's allocator ---------------------------------------------------------------------------------
 *
 * The C twin of kvpool/core/pool/allocator.py's SegmentAllocator: best fit over coalesced free extents, the same
 * offset for the same calls (the smallest free extent that fits, the lowest offset among equal ones, carved from
 * its start) and the same errors. A save places and evicts a group per chunk, each an allocation and a free: in
 * Python each was several dict and heap steps. Here the free extents are a treap ordered by (size, offset), so the
 * best fit is the first extent of size >= the need; three open-addressing maps hold the free extents by start and
 * by end (to merge with neighbours) and the live allocations by offset. O(log n) expected per call. Every mutating
 * call reserves its room first, so a lack of memory raises before anything changes. */

#define NO_KEY UINT64_MAX
#define MAX_CAPACITY ((uint64_t)1 << 62)

typedef struct {
    uint64_t key;
    uint64_t value;
} Entry;

typedef struct {
    Entry *entries;
    uint64_t mask;
    Py_ssize_t count;
    int shift;
} Map;

static int map_init(Map *m, int bits) {
    Entry *entries = PyMem_Malloc(sizeof(Entry) << bits);
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < ((size_t)1 << bits); i++) entries[i].key = NO_KEY;
    m->entries = entries;
    m->mask = ((uint64_t)1 << bits) - 1;
    m->count = 0;
    m->shift = 64 - bits;
    return 0;
}

static inline uint64_t map_home(const Map *m, uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> m->shift; }

static Entry *map_find(const Map *m, uint64_t key) {
    for (uint64_t i = map_home(m, key);; i = (i + 1) & m->mask) {
        Entry *e = &m->entries[i];
        if (e->key == key) return e;
        if (e->key == NO_KEY) return NULL;
    }
}

static void map_place(Map *m, uint64_t key, uint64_t value) { /* key absent, room reserved */
    uint64_t i = map_home(m, key);
    while (m->entries[i].key != NO_KEY) i = (i + 1) & m->mask;
    m->entries[i].key = key;
    m->entries[i].value = value;
    m->count++;
}

static int map_reserve(Map *m, Py_ssize_t more) { /* room for ``more`` new keys at a load of at most 1/2 */
    if ((uint64_t)(m->count + more) * 2 <= m->mask + 1) return 0;
    Map bigger;
    int bits = 64 - m->shift;
    while (((uint64_t)(m->count + more) * 2) > ((uint64_t)1 << bits)) bits++;
    if (bits > 40) {
        PyErr_SetString(PyExc_MemoryError, "an allocator's map outgrew 2**40 entries");
        return -1;
    }
    if (map_init(&bigger, bits) < 0) return -1;
    for (uint64_t i = 0; i <= m->mask; i++)
        if (m->entries[i].key != NO_KEY) map_place(&bigger, m->entries[i].key, m->entries[i].value);
    PyMem_Free(m->entries);
    *m = bigger;
    return 0;
}

static void map_remove(Map *m, Entry *e) { /* backward shift: no tombstones */
    uint64_t i = (uint64_t)(e - m->entries);
    for (uint64_t j = (i + 1) & m->mask;; j = (j + 1) & m->mask) {
        uint64_t key = m->entries[j].key;
        if (key == NO_KEY) break;
        /* entry j may fill the hole at i when i lies on its probe path, from its home to j */
        if (((j - map_home(m, key)) & m->mask) >= ((j - i) & m->mask)) {
            m->entries[i] = m->entries[j];
            i = j;
        }
    }
    m->entries[i].key = NO_KEY;
    m->count--;
}

typedef struct {
    uint64_t size;
    uint64_t offset;
    uint32_t priority;
    uint32_t left;
    uint32_t right;
} Node; /* node 0: none */

typedef struct {
    PyObject_HEAD
    uint64_t capacity;
    uint64_t alignment;
    uint64_t used;
    Map free_at;   /* a free extent's offset -> its size */
    Map free_end;  /* a free extent's end -> its offset */
    Map live;      /* a live allocation's offset -> its rounded size */
    Node *nodes;   /* the free extents, a treap by (size, offset) */
    uint32_t num_nodes;
    uint32_t node_capacity;
    uint32_t spare; /* a list of unused nodes, through .left */
    uint32_t root;
    uint64_t random;
} Allocator;

static PyObject *unknown_offset_error = NULL; /* kvpool.core.pool.allocator.UnknownOffsetError, once named */

static inline int less(uint64_t size, uint64_t offset, uint64_t other_size, uint64_t other_offset) {
    return size < other_size || (size == other_size && offset < other_offset);
}

static inline int before(uint64_t size, uint64_t offset, const Node *n) {
    return less(size, offset, n->size, n->offset);
}

static void treap_split(Node *n, uint32_t t, uint64_t size, uint64_t offset, uint32_t *l, uint32_t *r) {
    /* l: the keys before (size, offset); r: the others */
    while (t) {
        if (less(n[t].size, n[t].offset, size, offset)) {
            *l = t;
            l = &n[t].right;
            t = n[t].right;
        } else {
            *r = t;
            r = &n[t].left;
            t = n[t].left;
        }
    }
    *l = *r = 0;
}

static uint32_t treap_merge(Node *n, uint32_t a, uint32_t b) { /* every key of a before every key of b */
    uint32_t root = 0, *link = &root;
    while (a && b) {
        if (n[a].priority > n[b].priority) {
            *link = a;
            link = &n[a].right;
            a = n[a].right;
        } else {
            *link = b;
            link = &n[b].left;
            b = n[b].left;
        }
    }
    *link = a ? a : b;
    return root;
}

static int reserve(Allocator *a, Py_ssize_t extents) {
    /* room for ``extents`` more free extents and one more live allocation, before anything changes */
    if (map_reserve(&a->free_at, extents) < 0 || map_reserve(&a->free_end, extents) < 0 ||
        map_reserve(&a->live, 1) < 0)
        return -1;
    uint32_t spare = 0;
    for (uint32_t s = a->spare; s && spare < (uint32_t)extents; s = a->nodes[s].left) spare++;
    uint64_t need = (uint64_t)a->num_nodes + (uint64_t)(extents - spare);
    if (need <= a->node_capacity) return 0;
    uint64_t capacity = a->node_capacity ? a->node_capacity : 16;
    while (capacity < need) capacity *= 2;
    if (capacity > UINT32_MAX) {
        PyErr_SetString(PyExc_MemoryError, "an allocator holds at most 2**32 - 1 free extents");
        return -1;
    }
    Node *nodes = PyMem_Realloc(a->nodes, capacity * sizeof(Node));
    if (nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->nodes = nodes;
    a->node_capacity = (uint32_t)capacity;
    return 0;
}

static void add_free(Allocator *a, uint64_t offset, uint64_t size) { /* room reserved */
    map_place(&a->free_at, offset, size);
    map_place(&a->free_end, offset + size, offset);
    uint32_t x = a->spare;
    if (x)
        a->spare = a->nodes[x].left;
    else
        x = a->num_nodes++;
    Node *n = a->nodes;
    a->random ^= a->random << 13;
    a->random ^= a->random >> 7;
    a->random ^= a->random << 17;
    n[x] = (Node){size, offset, (uint32_t)(a->random >> 32), 0, 0};
    uint32_t l, r;
    treap_split(n, a->root, size, offset, &l, &r);
    a->root = treap_merge(n, treap_merge(n, l, x), r);
}

static void remove_free(Allocator *a, uint64_t offset, uint64_t size) { /* a free extent */
    map_remove(&a->free_at, map_find(&a->free_at, offset));
    map_remove(&a->free_end, map_find(&a->free_end, offset + size));
    Node *n = a->nodes;
    uint32_t *link = &a->root;
    while (*link) {
        uint32_t t = *link;
        if (n[t].size == size && n[t].offset == offset) {
            *link = treap_merge(n, n[t].left, n[t].right);
            n[t].left = a->spare;
            a->spare = t;
            return;
        }
        link = before(size, offset, &n[t]) ? &n[t].left : &n[t].right;
    }
}

static int carve(Allocator *a, uint64_t need, uint64_t *offset) {
    /* the best fit for ``need`` (rounded) bytes, taken from its start: 1, or 0 when none fits; room reserved */
    const Node *n = a->nodes;
    uint32_t best = 0;
    for (uint32_t t = a->root; t;) {
        if (n[t].size >= need) {
            best = t;
            t = n[t].left;
        } else {
            t = n[t].right;
        }
    }
    if (!best) return 0;
    uint64_t hole = n[best].size, at = n[best].offset;
    remove_free(a, at, hole);
    if (hole > need) add_free(a, at + need, hole - need);
    map_place(&a->live, at, need);
    a->used += need;
    *offset = at;
    return 1;
}

static void free_extent(Allocator *a, uint64_t start, uint64_t end) {
    /* [start, end), allocated until now, becomes free, merged with free neighbours; room reserved */
    a->used -= end - start;
    Entry *e = map_find(&a->free_end, start);
    if (e != NULL) {
        uint64_t left = e->value;
        remove_free(a, left, start - left);
        start = left;
    }
    e = map_find(&a->free_at, end);
    if (e != NULL) {
        uint64_t right = e->value;
        remove_free(a, end, right);
        end += right;
    }
    add_free(a, start, end - start);
}

static uint64_t rounded(const Allocator *a, uint64_t size) { return (size + a->alignment - 1) & ~(a->alignment - 1); }

static int positive_size(PyObject *obj, uint64_t *size) {
    /* 1: a positive int (``*size``: UINT64_MAX when it passes 63 bits); 0: not one; -1: an error set */
    if (!PyLong_Check(obj) || PyBool_Check(obj)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0) {
        *size = UINT64_MAX;
        return 1;
    }
    if (overflow < 0 || v <= 0) return 0;
    *size = (uint64_t)v;
    return 1;
}

static int offset_of(PyObject *obj, uint64_t *offset) {
    /* 1: an int that could be an offset; 0: one that cannot (so no allocation lies there); -1: an error set */
    if (!PyLong_Check(obj)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0) return 0;
    *offset = (uint64_t)v;
    return 1;
}

static PyObject *unknown_offset(PyObject *offset) {
    PyObject *message = PyUnicode_FromFormat("no live allocation at offset %S", offset);
    if (message != NULL) {
        PyErr_SetObject(unknown_offset_error ? unknown_offset_error : PyExc_KeyError, message);
        Py_DECREF(message);
    }
    return NULL;
}

static PyObject *Allocator_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    /* built whole here, not in __init__: no instance is ever half made */
    static char *names[] = {"capacity", "alignment", NULL};
    PyObject *capacity, *alignment = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O", names, &capacity, &alignment)) return NULL;
    uint64_t c, align = 64;
    int ok = positive_size(capacity, &c);
    if (ok < 0) return NULL;
    if (!ok || c > MAX_CAPACITY)
        return PyErr_Format(PyExc_ValueError, "capacity must be a positive int (at most 2**62), got %R", capacity);
    if (alignment != NULL) {
        ok = positive_size(alignment, &align);
        if (ok < 0) return NULL;
        if (!ok || align > MAX_CAPACITY || (align & (align - 1)))
            return PyErr_Format(PyExc_ValueError, "alignment must be a positive power of two, got %R", alignment);
    }
    Allocator *a = (Allocator *)type->tp_alloc(type, 0);
    if (a == NULL) return NULL;
    a->capacity = c;
    a->alignment = align;
    a->random = 0x2545F4914F6CDD1Dull;
    a->num_nodes = 1; /* node 0 stands for none */
    if (map_init(&a->free_at, 4) < 0 || map_init(&a->free_end, 4) < 0 || map_init(&a->live, 4) < 0 ||
        reserve(a, 1) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    add_free(a, 0, c);
    return (PyObject *)a;
}

static void Allocator_dealloc(Allocator *a) {
    PyMem_Free(a->free_at.entries);
    PyMem_Free(a->free_end.entries);
    PyMem_Free(a->live.entries);
    PyMem_Free(a->nodes);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *Allocator_rounded_size(Allocator *a, PyObject *size) {
    if (PyLong_Check(size)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(size, &overflow);
        if (v == -1 && PyErr_Occurred()) return NULL;
        if (!overflow && v >= 0 && (uint64_t)v <= MAX_CAPACITY) {
            if (!((uint64_t)v & (a->alignment - 1))) return Py_NewRef(size); /* aligned: the same int */
            return PyLong_FromUnsignedLongLong(rounded(a, (uint64_t)v));
        }
    }
    /* anything else as the Python twin computes it: -(-size // alignment) * alignment */
    PyObject *align = PyLong_FromUnsignedLongLong(a->alignment), *minus = NULL, *parts = NULL, *result = NULL;
    if (align != NULL && (minus = PyNumber_Negative(size)) != NULL &&
        (parts = PyNumber_FloorDivide(minus, align)) != NULL) {
        PyObject *whole = PyNumber_Negative(parts);
        if (whole != NULL) {
            result = PyNumber_Multiply(whole, align);
            Py_DECREF(whole);
        }
    }
    Py_XDECREF(align);
    Py_XDECREF(minus);
    Py_XDECREF(parts);
    return result;
}

static PyObject *Allocator_allocate(Allocator *a, PyObject *size) {
    uint64_t v, offset;
    int ok = positive_size(size, &v);
    if (ok < 0) return NULL;
    if (!ok) return PyErr_Format(PyExc_ValueError, "size must be a positive int, got %R", size);
    if (v > a->capacity) Py_RETURN_NONE;
    if (reserve(a, 1) < 0) return NULL;
    if (!carve(a, rounded(a, v), &offset)) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(offset);
}

/* the rounded sizes of a list of positive ints into ``needs`` (n of them); 1: their sum in ``*total`` (UINT64_MAX
 * past the capacity), 0: ValueError set, -1: an error set */
static int needs_of(Allocator *a, PyObject *fast, PyObject *sizes, uint64_t *needs, uint64_t *total) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        int ok = positive_size(items[i], &v);
        if (ok < 0) return -1;
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "sizes must be positive ints, got %R", sizes);
            return 0;
        }
        needs[i] = v > a->capacity ? UINT64_MAX : rounded(a, v);
        sum = (needs[i] == UINT64_MAX || sum > a->capacity) ? UINT64_MAX : sum + needs[i];
    }
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "sizes must be positive ints, got %R", sizes);
        return 0;
    }
    *total = sum;
    return 1;
}

#define FEW 16

static PyObject *Allocator_allocate_run(Allocator *a, PyObject *sizes) {
    PyObject *fast = PySequence_Fast(sizes, "sizes must be a sequence of positive ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t few[FEW], *needs = n <= FEW ? few : PyMem_Malloc(sizeof(uint64_t) * (size_t)n), total, offset;
    PyObject *result = NULL;
    if (needs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (needs_of(a, fast, sizes, needs, &total) <= 0) goto done;
    if (total > a->capacity) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (reserve(a, 1) < 0) goto done;
    if (!carve(a, total, &offset)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL) goto done; /* (the room stays taken: only out of memory) */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(offset);
        if (o == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, o);
        offset += needs[i];
    }
done:
    if (needs != few) PyMem_Free(needs);
    Py_DECREF(fast);
    return result;
}

static PyObject *Allocator_split_run(Allocator *a, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "split_run takes first and sizes, got %zd arguments", nargs);
    PyObject *fast = PySequence_Fast(args[1], "sizes must be a sequence of positive ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t few[FEW], *needs = n <= FEW ? few : PyMem_Malloc(sizeof(uint64_t) * (size_t)n), total, first;
    PyObject *result = NULL;
    if (needs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (needs_of(a, fast, args[1], needs, &total) <= 0) goto done;
    int ok = offset_of(args[0], &first);
    if (ok < 0) goto done;
    Entry *e = ok ? map_find(&a->live, first) : NULL;
    if (e == NULL || e->value != total) {
        PyErr_Format(unknown_offset_error ? unknown_offset_error : PyExc_KeyError,
                     "no live allocation of %llu bytes at offset %S to split", (unsigned long long)total, args[0]);
        goto done;
    }
    if (map_reserve(&a->live, n) < 0) goto done;
    result = PyList_New(n);
    if (result == NULL) goto done;
    uint64_t offset = first;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(offset);
        if (o == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, o);
        offset += needs[i];
    }
    map_find(&a->live, first)->value = needs[0];
    offset = first;
    for (Py_ssize_t i = 1; i < n; i++) {
        offset += needs[i - 1];
        map_place(&a->live, offset, needs[i]);
    }
done:
    if (needs != few) PyMem_Free(needs);
    Py_DECREF(fast);
    return result;
}

static Entry *live_at(Allocator *a, PyObject *offset_obj) {
    /* the live allocation at the offset named: its entry, or NULL with UnknownOffsetError (or another error) set */
    uint64_t offset;
    int ok = offset_of(offset_obj, &offset);
    if (ok < 0) return NULL;
    Entry *e = ok ? map_find(&a->live, offset) : NULL;
    if (e == NULL) unknown_offset(offset_obj);
    return e;
}

static PyObject *Allocator_free(Allocator *a, PyObject *offset_obj) {
    Entry *e = live_at(a, offset_obj);
    if (e == NULL) return NULL;
    uint64_t offset = e->key;
    if (reserve(a, 1) < 0) return NULL;
    e = map_find(&a->live, offset); /* (reserving may have moved it) */
    uint64_t size = e->value;
    map_remove(&a->live, e);
    free_extent(a, offset, offset + size);
    Py_RETURN_NONE;
}

static int compare_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

static PyObject *Allocator_free_run(Allocator *a, PyObject *offsets) {
    PyObject *fast = PySequence_Fast(offsets, "offsets must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t few[FEW], *sorted = n <= FEW ? few : PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    PyObject *result = NULL;
    if (sorted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int dead = -1; /* the first offset named that is no live allocation */
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = offset_of(items[i], &sorted[i]);
        if (ok < 0) goto done;
        if ((!ok || map_find(&a->live, sorted[i]) == NULL) && dead < 0) dead = (int)i;
        if (!ok) sorted[i] = NO_KEY;
    }
    qsort(sorted, (size_t)n, sizeof(uint64_t), compare_u64);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (sorted[i] == sorted[i - 1] && sorted[i] != NO_KEY) {
            PyObject *listed = PySequence_List(offsets);
            if (listed != NULL && PyList_Sort(listed) == 0)
                PyErr_Format(unknown_offset_error ? unknown_offset_error : PyExc_KeyError,
                             "offsets named twice in one run: %S", listed);
            Py_XDECREF(listed);
            goto done;
        }
    }
    if (dead >= 0) {
        unknown_offset(items[dead]);
        goto done;
    }
    if (n == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* runs of back-to-back allocations go back as one extent each */
    Py_ssize_t runs = 1;
    for (Py_ssize_t i = 1; i < n; i++) runs += sorted[i] != sorted[i - 1] + map_find(&a->live, sorted[i - 1])->value;
    if (reserve(a, runs) < 0) goto done;
    uint64_t start = sorted[0], end = sorted[0];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sorted[i] != end) {
            free_extent(a, start, end);
            start = sorted[i];
        }
        Entry *e = map_find(&a->live, sorted[i]);
        end = sorted[i] + e->value;
        map_remove(&a->live, e);
    }
    free_extent(a, start, end);
    result = Py_NewRef(Py_None);
done:
    if (sorted != few) PyMem_Free(sorted);
    Py_DECREF(fast);
    return result;
}

static PyObject *Allocator_allocation_size(Allocator *a, PyObject *offset_obj) {
    Entry *e = live_at(a, offset_obj);
    return e == NULL ? NULL : PyLong_FromUnsignedLongLong(e->value);
}

static PyObject *pairs_of(const Map *m) {
    PyObject *result = PyList_New(0);
    if (result == NULL) return NULL;
    for (uint64_t i = 0; i <= m->mask; i++) {
        const Entry *e = &m->entries[i];
        if (e->key == NO_KEY) continue;
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)e->key, (unsigned long long)e->value);
        if (pair == NULL || PyList_Append(result, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return result;
}

static PyObject *Allocator_extents(Allocator *a, PyObject *unused) { return pairs_of(&a->free_at); }

static PyObject *Allocator_live(Allocator *a, PyObject *unused) { return pairs_of(&a->live); }

static Py_ssize_t check_treap(const Allocator *a, uint32_t t, const Node *low, const Node *high, int *bad) {
    /* the nodes under t, each between low and high, below its parent's priority, and a free extent */
    Py_ssize_t count = 0;
    while (t && !*bad) {
        const Node *n = &a->nodes[t];
        Entry *e = map_find(&a->free_at, n->offset), *end = map_find(&a->free_end, n->offset + n->size);
        if ((low && !before(low->size, low->offset, n)) || (high && !before(n->size, n->offset, high)) ||
            e == NULL || e->value != n->size || end == NULL || end->value != n->offset ||
            map_find(&a->free_end, n->offset) != NULL || map_find(&a->free_at, n->offset + n->size) != NULL ||
            (n->left && a->nodes[n->left].priority > n->priority) ||
            (n->right && a->nodes[n->right].priority > n->priority)) {
            *bad = 1;
            return count;
        }
        count += 1 + check_treap(a, n->left, low, n, bad);
        low = n;
        t = n->right;
    }
    return count;
}

static PyObject *Allocator_check(Allocator *a, PyObject *unused) {
    int bad = 0;
    Py_ssize_t count = check_treap(a, a->root, NULL, NULL, &bad);
    uint64_t live = 0, free = 0;
    for (uint64_t i = 0; i <= a->live.mask; i++)
        if (a->live.entries[i].key != NO_KEY) live += a->live.entries[i].value;
    for (uint64_t i = 0; i <= a->free_at.mask; i++)
        if (a->free_at.entries[i].key != NO_KEY) free += a->free_at.entries[i].value;
    if (bad || count != a->free_at.count || count != a->free_end.count || live != a->used ||
        live + free != a->capacity) {
        PyErr_Format(PyExc_AssertionError,
                     "allocator out of step: tree %s, %zd nodes, %zd extents by start, %zd by end, %llu live bytes, "
                     "%llu counted, %llu free of %llu", bad ? "broken" : "in order", count, a->free_at.count,
                     a->free_end.count, (unsigned long long)live, (unsigned long long)a->used,
                     (unsigned long long)free, (unsigned long long)a->capacity);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Allocator_get(Allocator *a, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromUnsignedLongLong(a->capacity);
    case 1: return PyLong_FromUnsignedLongLong(a->alignment);
    case 2: return PyLong_FromUnsignedLongLong(a->used);
    case 3: return PyLong_FromUnsignedLongLong(a->capacity - a->used);
    case 4: {
        uint32_t t = a->root;
        if (!t) return PyLong_FromLong(0);
        while (a->nodes[t].right) t = a->nodes[t].right;
        return PyLong_FromUnsignedLongLong(a->nodes[t].size);
    }
    case 5: return PyLong_FromSsize_t(a->live.count);
    default: return PyLong_FromSsize_t(a->free_at.count);
    }
}

static PyGetSetDef Allocator_getset[] = {
    {"capacity", (getter)Allocator_get, NULL, "The segment's bytes.", (void *)0},
    {"alignment", (getter)Allocator_get, NULL, "Every allocation starts at a multiple of it.", (void *)1},
    {"used_bytes", (getter)Allocator_get, NULL, "Bytes allocated (rounded sizes).", (void *)2},
    {"free_bytes", (getter)Allocator_get, NULL, "Bytes not allocated.", (void *)3},
    {"largest_free", (getter)Allocator_get, NULL, "The largest free extent's size (0 when full).", (void *)4},
    {"num_allocations", (getter)Allocator_get, NULL, "Live allocations.", (void *)5},
    {"num_free_extents", (getter)Allocator_get, NULL, "Free extents.", (void *)6},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Allocator_methods[] = {
    {"rounded_size", (PyCFunction)Allocator_rounded_size, METH_O, "Bytes an allocation of size takes."},
    {"allocate", (PyCFunction)Allocator_allocate, METH_O, "The best fit's offset for size bytes, or None."},
    {"allocate_run", (PyCFunction)Allocator_allocate_run, METH_O,
     "One allocation for pieces of these sizes back to back: each piece's offset, or None."},
    {"split_run", (PyCFunction)(void (*)(void))Allocator_split_run, METH_FASTCALL,
     "split_run(first, sizes): a run's pieces become allocations of their own; their offsets."},
    {"free", (PyCFunction)Allocator_free, METH_O, "Give back the allocation at an offset."},
    {"free_run", (PyCFunction)Allocator_free_run, METH_O, "Give back the allocations at these offsets at once."},
    {"allocation_size", (PyCFunction)Allocator_allocation_size, METH_O, "The rounded size of a live allocation."},
    {"extents", (PyCFunction)Allocator_extents, METH_NOARGS, "The free extents, (offset, size) pairs, unordered."},
    {"live", (PyCFunction)Allocator_live, METH_NOARGS, "The live allocations, (offset, size) pairs, unordered."},
    {"check", (PyCFunction)Allocator_check, METH_NOARGS, "AssertionError unless the structures agree (tests)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool_lru.Allocator",
    .tp_doc = "A segment's best-fit allocator (kvpool/core/pool/allocator.py).",
    .tp_basicsize = sizeof(Allocator),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = Allocator_new,
    .tp_dealloc = (destructor)Allocator_dealloc,
    .tp_methods = Allocator_methods,
    .tp_getset = Allocator_getset,
};

static PyObject *name_unknown_offset_error(PyObject *unused, PyObject *cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_KeyError))
        return PyErr_Format(PyExc_TypeError, "the allocator's error must be a KeyError class, got %R", cls);
    Py_XSETREF(unknown_offset_error, Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"leading", fields_leading, METH_VARARGS, "leading(items, cls, name): how many leading items' field is True."},
    {"count", fields_count, METH_VARARGS, "count(items, cls, name): how many items' field is True."},
    {"values", fields_values, METH_VARARGS, "values(items, cls, name): the items' fields, a list."},
    {"add", fields_add, METH_VARARGS, "add(items, cls, name, delta): each item's int field grows by delta."},
    {"join_pairs", fields_join_pairs, METH_O,
     "join_pairs(pairs): (bytes, tuple) pairs' bytes joined, and the set of their tuples' items."},
    {"name_unknown_offset_error", name_unknown_offset_error, METH_O,
     "The KeyError class an allocator raises for an offset with no live allocation."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool_lru",
    "The pool index's order of groups, passes over group records and a segment's allocator "
    "(kvpool/core/pool/lru.py, fields.py, allocator.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit_kvpool_lru(void) {
    if (PyType_Ready(&OrderType) < 0 || PyType_Ready(&AllocatorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Order", (PyObject *)&OrderType) < 0 ||
        PyModule_AddObjectRef(m, "Allocator", (PyObject *)&AllocatorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

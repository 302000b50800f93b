/* The pool index's order of groups, least recently used first: a doubly linked list over slots.
 *
 * Each group the index holds has a slot (a small int, kvpool/core/pool/lru.py). An order keeps, per slot, its
 * neighbours in two int32 arrays: moving a group to either end is a few stores, not a hash lookup and a relink in
 * an ordered dict whose entries lie all over memory (a lookup touches a whole history: 450 groups). The arrays
 * grow with the slots (``kvpool_lru_grow``).
 *
 * prev[s] == OUT: slot s is not in the order; END marks either end. Every function checks its slots against the
 * capacity and membership, so a wrong call is refused (-1), never a write out of bounds.
 */

#include <stdint.h>
#include <stdlib.h>

#define END (-1)
#define OUT (-2)

typedef struct {
    int32_t *prev;
    int32_t *next;
    int64_t capacity;
    int64_t count;
    int32_t head;
    int32_t tail;
} kvpool_lru;

static int valid(const kvpool_lru *o, int64_t s) { return s >= 0 && s < o->capacity; }

static int member(const kvpool_lru *o, int64_t s) { return valid(o, s) && o->prev[s] != OUT; }

int kvpool_lru_grow(kvpool_lru *o, int64_t capacity) {
    if (capacity <= o->capacity) return 0;
    if (capacity > INT32_MAX) return -1;
    int32_t *prev = realloc(o->prev, (size_t)capacity * sizeof(int32_t));
    if (prev == NULL) return -1;
    o->prev = prev;
    int32_t *next = realloc(o->next, (size_t)capacity * sizeof(int32_t));
    if (next == NULL) return -1;
    o->next = next;
    for (int64_t s = o->capacity; s < capacity; s++) prev[s] = next[s] = OUT;
    o->capacity = capacity;
    return 0;
}

kvpool_lru *kvpool_lru_new(int64_t capacity) {
    kvpool_lru *o = calloc(1, sizeof(kvpool_lru));
    if (o == NULL) return NULL;
    o->head = o->tail = END;
    if (kvpool_lru_grow(o, capacity > 0 ? capacity : 1) != 0) {
        free(o->prev);
        free(o->next);
        free(o);
        return NULL;
    }
    return o;
}

void kvpool_lru_free(kvpool_lru *o) {
    if (o == NULL) return;
    free(o->prev);
    free(o->next);
    free(o);
}

int64_t kvpool_lru_count(const kvpool_lru *o) { return o->count; }

int kvpool_lru_contains(const kvpool_lru *o, int64_t s) { return member(o, s); }

static void unlink_slot(kvpool_lru *o, int32_t s) {
    int32_t p = o->prev[s], n = o->next[s];
    if (p == END) o->head = n; else o->next[p] = n;
    if (n == END) o->tail = p; else o->prev[n] = p;
}

static void link_back(kvpool_lru *o, int32_t s) {
    o->prev[s] = o->tail;
    o->next[s] = END;
    if (o->tail == END) o->head = s; else o->next[o->tail] = s;
    o->tail = s;
}

static void link_front(kvpool_lru *o, int32_t s) {
    o->next[s] = o->head;
    o->prev[s] = END;
    if (o->head == END) o->tail = s; else o->prev[o->head] = s;
    o->head = s;
}

int kvpool_lru_push_back(kvpool_lru *o, int64_t s) {
    if (!valid(o, s) || member(o, s)) return -1;
    link_back(o, (int32_t)s);
    o->count++;
    return 0;
}

int kvpool_lru_remove(kvpool_lru *o, int64_t s) {
    if (!member(o, s)) return -1;
    unlink_slot(o, (int32_t)s);
    o->prev[s] = o->next[s] = OUT;
    o->count--;
    return 0;
}

/* Each slot of ``slots`` that is in the order, from the last to the first, moved to the back: the first named
 * ends the most recently used (an ordered dict's move_to_end over the reversed list). Returns how many moved. */
int64_t kvpool_lru_touch(kvpool_lru *o, const int32_t *slots, int64_t n) {
    int64_t moved = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        int32_t s = slots[i];
        if (!member(o, s)) continue;
        moved++;
        if (o->tail == s) continue;
        unlink_slot(o, s);
        link_back(o, s);
    }
    return moved;
}

/* Each slot of ``slots`` that is in the order, first to last, moved to the front: the last named ends the least
 * recently used. Returns how many moved. */
int64_t kvpool_lru_demote(kvpool_lru *o, const int32_t *slots, int64_t n) {
    int64_t moved = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (!member(o, s)) continue;
        moved++;
        if (o->head == s) continue;
        unlink_slot(o, s);
        link_front(o, s);
    }
    return moved;
}

/* Up to ``n`` slots in order into ``out``: from the front when ``after`` is END, else from the one after slot
 * ``after``. Returns how many were written; -1 when ``after`` is not in the order (it left since the caller read
 * it: the order changed under an iteration). */
int64_t kvpool_lru_read(const kvpool_lru *o, int64_t after, int32_t *out, int64_t n) {
    int32_t s;
    if (after == END) {
        s = o->head;
    } else {
        if (!member(o, after)) return -1;
        s = o->next[after];
    }
    int64_t written = 0;
    while (s != END && written < n) {
        out[written++] = s;
        s = o->next[s];
    }
    return written;
}

/* ``dst`` (empty, at least as large) gets ``src``'s slots in ``src``'s order. Returns how many; -1 when ``dst`` is
 * not empty or smaller. */
int64_t kvpool_lru_copy(kvpool_lru *dst, const kvpool_lru *src) {
    if (dst->count != 0 || dst->capacity < src->capacity) return -1;
    for (int32_t s = src->head; s != END; s = src->next[s]) link_back(dst, s);
    dst->count = src->count;
    return dst->count;
}

/* Work ranges with stealing, for loops whose items are independent and cost
 * about the same (GEMM panels).  Thread t owns items [first, end) of its
 * range, takes them from the front, and once its own range is empty takes
 * from the back of the others'.  A thread the OS or the hypervisor deschedules
 * mid-loop then delays the loop by the item it holds, not by its whole share;
 * with nobody descheduled every thread runs exactly its own contiguous range,
 * so it knows its next item ahead (for prefetching: GEMM panels, attention
 * items).
 * A range is one atomic word (end << 32 | next), so owner and thief agree on
 * every item without a lock.  Nothing here carries a target attribute. */
#ifndef CPUD_WORK_RANGES_H
#define CPUD_WORK_RANGES_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    _Alignas(64) _Atomic uint64_t word; /* own cache line: owners do not contend */
} work_range;

/* n items split evenly over nt ranges; NULL when out of memory. */
static inline work_range *work_ranges_new(int64_t n, int nt) {
    work_range *r = aligned_alloc(64, sizeof(work_range) * (size_t)nt);
    if (!r) return NULL;
    for (int t = 0; t < nt; t++) {
        const uint64_t first = (uint64_t)(n * t / nt), end = (uint64_t)(n * (t + 1) / nt);
        atomic_init(&r[t].word, end << 32 | first);
    }
    return r;
}

/* The ranges of work_ranges_new(n, nt) as they were made; no thread may be taking items. */
static inline void work_ranges_reset(work_range *r, int64_t n, int nt) {
    for (int t = 0; t < nt; t++) {
        const uint64_t first = (uint64_t)(n * t / nt), end = (uint64_t)(n * (t + 1) / nt);
        atomic_store_explicit(&r[t].word, end << 32 | first, memory_order_relaxed);
    }
}

/* Next item of range r from the front (owner) or back (thief); -1 when empty. */
static inline int64_t work_take(work_range *r, int back) {
    uint64_t v = atomic_load_explicit(&r->word, memory_order_relaxed);
    for (;;) {
        const uint64_t next = v & 0xffffffffu, end = v >> 32;
        if (next >= end) return -1;
        const uint64_t want = back ? (end - 1) << 32 | next : end << 32 | (next + 1);
        if (atomic_compare_exchange_weak_explicit(&r->word, &v, want, memory_order_relaxed,
                                                  memory_order_relaxed))
            return (int64_t)(back ? end - 1 : next);
    }
}

/* Thread tid's next item: its own range first, then the others' in turn. */
static inline int64_t work_next(work_range *r, int nt, int tid) {
    int64_t i = work_take(&r[tid], 0);
    for (int k = 1; i < 0 && k < nt; k++) i = work_take(&r[(tid + k) % nt], 1);
    return i;
}

/* Whether item i is one of thread tid's own (work_ranges_new(n, nt)), not a stolen one. */
static inline int work_owns(int64_t n, int nt, int tid, int64_t i) {
    return i >= n * tid / nt && i < n * (tid + 1) / nt;
}

/* Whether item i + 1 is still in range r (a hint: it may be taken meanwhile). */
static inline int work_has_after(work_range *r, int64_t i) {
    const uint64_t v = atomic_load_explicit(&r->word, memory_order_relaxed);
    return (uint64_t)(i + 1) < (v >> 32);
}

#endif

/* Work stealing over a parallel op's numbered tasks.  Thread t of nth owns a run of tasks, first
 * its static share [T t / nth, T (t + 1) / nth), kept in one word of its slot with the op's
 * generation: it takes chunks from the front of its run, and once the run is empty it takes the
 * back half of another thread's, which becomes its own run (and can be taken from in turn).  A
 * slot still holding an older generation is set to its owner's share by whichever thread reads
 * it first, so a thread that starts late has its share taken by the others.  Each task runs once,
 * on whichever thread claims it; shares stay contiguous (one stream through the weights per
 * thread) until a thread runs dry.  No target attributes here. */
#ifndef CPUD_TASK_STEAL_H
#define CPUD_TASK_STEAL_H

#include <stdatomic.h>
#include <stdint.h>

/* Runs are packed as next | end << 24 | generation << 48. */
#define STEAL_MAX_TASKS (INT64_C(1) << 24)

typedef struct task_slot {
    _Alignas(64) _Atomic uint64_t run;
} task_slot;

/* The shared state of one op: nth slots (zeroed once: generation 0 is never an op's) and this
 * op's generation, the same on every thread and unlike the previous op's on these slots. */
typedef struct task_steal {
    task_slot *slots;
    uint64_t gen;
} task_steal;

static inline uint64_t steal_pack(int64_t next, int64_t end, uint64_t gen) {
    return (uint64_t)next | (uint64_t)end << 24 | (gen & 0xffff) << 48;
}
static inline int64_t steal_next(uint64_t w) { return (int64_t)(w & 0xffffff); }
static inline int64_t steal_end(uint64_t w) { return (int64_t)((w >> 24) & 0xffffff); }

/* Slot v's word for this op, set to thread v's share of tasks first where it holds an older
 * generation's. */
static inline uint64_t steal_load(const task_steal *st, int v, int nth, int64_t tasks) {
    task_slot *slot = &st->slots[v];
    uint64_t w = atomic_load_explicit(&slot->run, memory_order_relaxed);
    while (w >> 48 != (st->gen & 0xffff)) {
        const uint64_t share = steal_pack(tasks * v / nth, tasks * (v + 1) / nth, st->gen);
        if (atomic_compare_exchange_weak_explicit(&slot->run, &w, share, memory_order_relaxed,
                                                  memory_order_relaxed))
            return share;
    }
    return w;
}

/* Up to c tasks from the front of thread tid's run: the first in *first, the count returned
 * (0: the run is empty). */
static inline int64_t steal_take(const task_steal *st, int tid, int nth, int64_t tasks, int64_t c,
                                 int64_t *first) {
    uint64_t w = steal_load(st, tid, nth, tasks);
    for (;;) {
        const int64_t n = steal_next(w), e = steal_end(w), k = e - n < c ? e - n : c;
        if (k <= 0) return 0;
        if (atomic_compare_exchange_weak_explicit(&st->slots[tid].run, &w,
                                                  steal_pack(n + k, e, st->gen),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *first = n;
            return k;
        }
    }
}

/* The back half of victim v's run (at least its last task) made thread tid's run, whose own is
 * empty; whether there was any. */
static inline int steal_half(const task_steal *st, int v, int tid, int nth, int64_t tasks) {
    uint64_t w = steal_load(st, v, nth, tasks);
    for (;;) {
        const int64_t n = steal_next(w), e = steal_end(w), mid = n + (e - n) / 2;
        if (n >= e) return 0;
        if (atomic_compare_exchange_weak_explicit(&st->slots[v].run, &w,
                                                  steal_pack(n, mid, st->gen),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            atomic_store_explicit(&st->slots[tid].run, steal_pack(mid, e, st->gen),
                                  memory_order_relaxed);
            return 1;
        }
    }
}

/* Runs task(ctx, t) for the tasks thread tid claims, until no thread's run has any left.  The
 * caller's barrier after it publishes the tasks' results. */
#define STEAL_RUN(st, tid, nth, tasks, task, ctx)                                                  \
    do {                                                                                           \
        const int64_t share_ = (tasks) / (nth), chunk_ = share_ / 16 > 1 ? share_ / 16 : 1;       \
        int64_t first_, k_;                                                                        \
        for (int d_ = 1;;) {                                                                       \
            while ((k_ = steal_take((st), (tid), (nth), (tasks), chunk_, &first_)) > 0)           \
                for (int64_t t_ = first_; t_ < first_ + k_; t_++) task((ctx), t_);               \
            if (d_ >= (nth)) break;                                                                \
            if (!steal_half((st), ((tid) + d_) % (nth), (tid), (nth), (tasks))) d_++;             \
        }                                                                                          \
    } while (0)

#endif

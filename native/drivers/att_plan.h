/* The work list of one paged-attention call: its items ((query tile, kv head) pairs, a decode
 * query over a long context split into parts of its keys) and the work ranges the threads take
 * them from (work_ranges.h).  Built once per step; a decoder's thread team re-arms the ranges
 * before each layer's attention.  No target attributes. */
#ifndef CPUD_ATT_PLAN_H
#define CPUD_ATT_PLAN_H

#include <math.h>
#include <string.h>

#include "cpud_native.h"
#include "work_ranges.h"

/* (query, head) rows handled by one work item: ATT_ROWS / G queries of one
 * sequence times the G heads of one kv head (one query when G > ATT_ROWS). */
#define ATT_ROWS 64

/* A decode item (a sequence's queries of a step that fit one tile: one query, or a speculative
 * verification, with the G heads of a kv head) over keys of more than one part is split into an
 * item per part, so a context's keys spread over the threads however few kv heads and
 * sequences there are.  The parts are fixed ranges of key positions: ATT_SPLIT_KEYS keys each,
 * every ATT_SPLIT_GROW parts twice as long as the ones before (1024 keys up to 16k, 2048 up to
 * 48k, ...).  Each part leaves its rows' unnormalised outputs, maxima and sums in a slot; the
 * part that finishes last merges them in part order (att_part_finish).  Since the ranges do not
 * depend on the context, a row's keys are split and merged the same way whatever the other
 * rows of its item are: a query gives the same bits decoded alone or inside a verification
 * (greedy speculative decoding stays token for token the same), on any thread count, beside
 * any batch.  Parts wholly before a sliding window are left out; models of more than
 * ATT_SPLIT_KV_HEADS kv heads have threads enough and are not split.  Measured on 2 threads
 * (Zen 4, bf16 cache, perf/ab_attention_builds.py): one stream at 8192 keys 1.86-2.06x with one
 * kv head, 1.02-1.08x with 8; 8 and 32 streams at 4096 keys 0.99-1.02x (parts of 512 keys:
 * 0.97x there, each item's start costs). */
#ifndef ATT_SPLIT_KEYS
#define ATT_SPLIT_KEYS 1024
#endif
#define ATT_SPLIT_GROW 16
#define ATT_SPLIT_KV_HEADS 16

typedef struct att_item {
    int32_t s;            /* sequence */
    int32_t q0;           /* first query of the tile, index within the sequence */
    int32_t nq;           /* queries in the tile */
    int32_t kvh;          /* kv head */
    int32_t k0, k1;       /* the keys it may read, [k0, k1]: all, or its part's share */
    int32_t part, nparts; /* its part of a split, 0 .. nparts - 1; nparts 1: not split */
    float *parts;         /* split: the parts' slots, part p's at p * att_slot_floats */
    uint32_t *arrivals;   /* split: parts finished, over all the step's layers */
} att_item;

typedef struct att_plan {
    att_item *items;    /* [n] */
    int64_t n;          /* items */
    work_range *ranges; /* [nr]: one per thread that may take items */
    int nr;
    float *slots;       /* the split items' slots, or NULL */
    uint32_t *arrivals; /* [splits] */
} att_plan;

/* Floats of one part's slot for R rows of hd: outputs [R][hd], maxima [R], sums [R], rounded
 * up to a cache line. */
static inline int64_t att_slot_floats(int64_t R, int64_t hd) {
    return (R * hd + 2 * R + 15) & ~(int64_t)15;
}

/* The first key of part k. */
static inline int64_t att_part_start(int64_t k) {
    int64_t start = 0, size = ATT_SPLIT_KEYS;
    for (; k >= ATT_SPLIT_GROW; k -= ATT_SPLIT_GROW, size *= 2) start += ATT_SPLIT_GROW * size;
    return start + k * size;
}

/* The part key j falls in. */
static inline int64_t att_part_of(int64_t j) {
    int64_t k = 0, size = ATT_SPLIT_KEYS;
    for (; j >= ATT_SPLIT_GROW * size; j -= ATT_SPLIT_GROW * size, size *= 2) k += ATT_SPLIT_GROW;
    return k + j / size;
}

/* The first key a query at position p attends under a sliding window (0: none; the last is
 * p). */
static inline int64_t att_window_start(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* The parts [*kf, *kf + n) of a sequence's q_len queries (tiles of `tile`) over ctx keys, for
 * nkv kv heads under a window; n 1: not split. */
static inline int64_t att_parts(int64_t q_len, int64_t tile, int64_t ctx, int64_t nkv,
                                int64_t window, int64_t *kf) {
    *kf = att_part_of(att_window_start(ctx - q_len, window));
    const int64_t n = att_part_of(ctx - 1) - *kf + 1;
    return q_len >= 1 && q_len <= tile && nkv <= ATT_SPLIT_KV_HEADS && n >= 2 ? n : 1;
}

/* Items of S sequences (query_start_loc qsl, seq_lens sl) for nh query and nkv kv heads of
 * hd under a sliding window (0: none), ranges for nr threads; CPUD_OK, or CPUD_ENOMEM (then
 * nothing to free). */
static inline int att_plan_new(const int32_t *qsl, const int32_t *sl, int64_t S, int64_t nh,
                               int64_t nkv, int64_t hd, int64_t window, int nr, att_plan *p) {
    const int64_t G = nh / nkv, tile = ATT_ROWS / G > 0 ? ATT_ROWS / G : 1;
    int64_t n = 0, slot_floats = 0, splits = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t q_len = qsl[s + 1] - qsl[s];
        int64_t kf;
        const int64_t parts = q_len > 0 ? att_parts(q_len, tile, sl[s], nkv, window, &kf) : 1;
        n += nkv * (parts > 1 ? parts : (q_len + tile - 1) / tile);
        if (parts > 1) {
            slot_floats += nkv * parts * att_slot_floats(q_len * G, hd);
            splits += nkv;
        }
    }
    *p = (att_plan){NULL, n, NULL, nr, NULL, NULL};
    if (n == 0) return CPUD_OK;
    p->items = malloc(sizeof(att_item) * (size_t)n);
    p->ranges = p->items ? work_ranges_new(n, nr) : NULL;
    if (splits) {
        p->slots = aligned_alloc(64, sizeof(float) * (size_t)slot_floats);
        p->arrivals = calloc((size_t)splits, sizeof(uint32_t));
    }
    if (!p->ranges || (splits && (!p->slots || !p->arrivals))) {
        free(p->items);
        free(p->ranges);
        free(p->slots);
        free(p->arrivals);
        return CPUD_ENOMEM;
    }
    int64_t i = 0, used = 0, split = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t q_len = qsl[s + 1] - qsl[s];
        int64_t kf;
        const int64_t parts = q_len > 0 ? att_parts(q_len, tile, sl[s], nkv, window, &kf) : 1;
        if (parts > 1) {
            const int64_t slot = att_slot_floats(q_len * G, hd);
            for (int64_t h = 0; h < nkv; h++, split++, used += parts * slot)
                for (int64_t k = 0; k < parts; k++) {
                    /* the first part also takes the keys before it (none attended) */
                    const int64_t k0 = k ? att_part_start(kf + k) : 0;
                    const int64_t k1 = k + 1 < parts ? att_part_start(kf + k + 1) - 1 : INT32_MAX;
                    p->items[i++] = (att_item){.s = (int32_t)s,
                                               .nq = (int32_t)q_len,
                                               .kvh = (int32_t)h,
                                               .k0 = (int32_t)k0,
                                               .k1 = (int32_t)k1,
                                               .part = (int32_t)k,
                                               .nparts = (int32_t)parts,
                                               .parts = p->slots + used,
                                               .arrivals = p->arrivals + split};
                }
            continue;
        }
        for (int64_t q0 = 0; q0 < q_len; q0 += tile)
            for (int64_t h = 0; h < nkv; h++)
                p->items[i++] = (att_item){(int32_t)s, (int32_t)q0,
                                           (int32_t)(q_len - q0 < tile ? q_len - q0 : tile),
                                           (int32_t)h, 0, INT32_MAX, 0, 1, NULL, NULL};
    }
    return CPUD_OK;
}

/* A part of a split item is done with its R rows (row r's unnormalised output at o + r * ostride,
 * [hd] in key order, its running max m[r] and sum l[r]): they go to its slot.  Returns 0, or
 * when it is the split's last part to finish, 1 with the merged rows in o and l (every part's
 * rows rescaled to the largest max; m untouched), ready to be normalised and written like an
 * unsplit item's.  Parts are merged in part order, whichever thread merges them. */
static inline int att_part_finish(const att_item *it, int64_t R, int64_t hd, float *o,
                                  int64_t ostride, const float *m, float *l) {
    const int64_t slot = att_slot_floats(R, hd);
    float *mine = it->parts + it->part * slot;
    for (int64_t r = 0; r < R; r++) {
        if (m[r] > -INFINITY) /* a row that attended nothing (and no sink) adds nothing */
            memcpy(mine + r * hd, o + r * ostride, sizeof(float) * (size_t)hd);
        mine[R * hd + r] = m[r];
        mine[R * hd + R + r] = l[r];
    }
    if (__atomic_add_fetch(it->arrivals, 1, __ATOMIC_ACQ_REL) % (uint32_t)it->nparts) return 0;
    for (int64_t r = 0; r < R; r++) {
        float *dst = o + r * ostride, mx = -INFINITY, sum = 0.0f;
        for (int32_t k = 0; k < it->nparts; k++) {
            const float mk = it->parts[k * slot + R * hd + r];
            mx = mk > mx ? mk : mx;
        }
        memset(dst, 0, sizeof(float) * (size_t)hd);
        for (int32_t k = 0; k < it->nparts && mx > -INFINITY; k++) {
            const float *part = it->parts + k * slot, mk = part[R * hd + r];
            if (mk == -INFINITY) continue; /* attended none of its keys: nothing to add */
            const float e = expf(mk - mx);
            sum += e * part[R * hd + R + r];
            for (int64_t d = 0; d < hd; d++) dst[d] += e * part[r * hd + d];
        }
        l[r] = sum;
    }
    return 1;
}

/* Every item untaken again; no thread may be taking items meanwhile. */
static inline void att_plan_rearm(att_plan *p) {
    if (p->ranges) work_ranges_reset(p->ranges, p->n, p->nr);
}

static inline void att_plan_free(att_plan *p) {
    free(p->ranges);
    free(p->items);
    free(p->slots);
    free(p->arrivals);
    *p = (att_plan){NULL, 0, NULL, p->nr, NULL, NULL};
}

#endif

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

/* Keys per part of a split decode item: a sequence's queries of a step (one, or up to
 * ATT_SPLIT_QUERIES within one tile: a speculative verification), with the G heads of a kv head,
 * over n >= 2 ATT_SPLIT_KEYS keys (those a sliding window leaves) become n / ATT_SPLIT_KEYS
 * items (at most ATT_SPLIT_ITEMS over its kv heads), each over its share of the keys (whole
 * chunks of 32), so a context's keys spread over the threads however few kv heads and sequences
 * there are.  Each part leaves its rows' unnormalised outputs, maxima and sums in a slot; the
 * part that finishes last merges them (att_part_finish).  The split depends on the context, the
 * model and the window alone, not on the thread count or the rest of the batch, so the outputs
 * do not either.  Measured on 2 threads (Zen 4, bf16 cache, perf/ab_attention_builds.py): one
 * stream at 8192 keys 1.86-2.06x with one kv head, 1.02-1.08x with 8; 8 and 32 streams at 4096
 * keys 0.99-1.02x (parts of 512 keys: 0.97x there, each item's start costs). */
#ifndef ATT_SPLIT_KEYS
#define ATT_SPLIT_KEYS 1024
#endif
#define ATT_SPLIT_ITEMS 64
#define ATT_SPLIT_QUERIES 8

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

/* Parts of a sequence's nq queries of a step (tiles of `tile` queries) whose last sees ctx
 * keys, for each of nkv kv heads. */
static inline int64_t att_parts(int64_t nq, int64_t tile, int64_t ctx, int64_t nkv) {
    const int64_t most = ATT_SPLIT_ITEMS / nkv, parts = ctx / ATT_SPLIT_KEYS;
    const int split = nq >= 1 && nq <= ATT_SPLIT_QUERIES && nq <= tile && parts >= 2 && most >= 2;
    return split ? (parts < most ? parts : most) : 1;
}

/* The first key any of a sequence's q_len queries over ctx keys attends under a sliding window
 * (0: none). */
static inline int64_t att_first_key(int64_t q_len, int64_t ctx, int64_t window) {
    return window > 0 && ctx - q_len - window + 1 > 0 ? ctx - q_len - window + 1 : 0;
}

/* Items of S sequences (query_start_loc qsl, seq_lens sl) for nh query and nkv kv heads of
 * hd under a sliding window (0: none; a split covers the keys the window leaves), ranges for nr
 * threads; CPUD_OK, or CPUD_ENOMEM (then nothing to free). */
static inline int att_plan_new(const int32_t *qsl, const int32_t *sl, int64_t S, int64_t nh,
                               int64_t nkv, int64_t hd, int64_t window, int nr, att_plan *p) {
    const int64_t G = nh / nkv, tile = ATT_ROWS / G > 0 ? ATT_ROWS / G : 1;
    int64_t n = 0, slot_floats = 0, splits = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t q_len = qsl[s + 1] - qsl[s];
        const int64_t keys = sl[s] - att_first_key(q_len, sl[s], window);
        const int64_t parts = att_parts(q_len, tile, keys, nkv);
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
        const int64_t q_len = qsl[s + 1] - qsl[s], first = att_first_key(q_len, sl[s], window);
        const int64_t keys = sl[s] - first, parts = att_parts(q_len, tile, keys, nkv);
        if (parts > 1) {
            const int64_t slot = att_slot_floats(q_len * G, hd);
            for (int64_t h = 0; h < nkv; h++, split++, used += parts * slot)
                for (int64_t k = 0; k < parts; k++) {
                    /* part k: from key first + k keys / parts, down to a chunk of 32 */
                    const int64_t k0 = k ? (first + k * keys / parts) & ~31 : 0;
                    const int64_t k1 =
                        k + 1 < parts ? ((first + (k + 1) * keys / parts) & ~31) - 1 : INT32_MAX;
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

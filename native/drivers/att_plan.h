/* The work list of one paged-attention call: its items ((query tile, kv head) pairs) and the
 * work ranges the threads take them from (work_ranges.h).  Built once per step; a decoder's
 * thread team re-arms the ranges before each layer's attention.  No target attributes. */
#ifndef CPUD_ATT_PLAN_H
#define CPUD_ATT_PLAN_H

#include "cpud_native.h"
#include "work_ranges.h"

/* (query, head) rows handled by one work item: ATT_ROWS / G queries of one
 * sequence times the G heads of one kv head (one query when G > ATT_ROWS). */
#define ATT_ROWS 64

typedef struct att_item {
    int32_t s;   /* sequence */
    int32_t q0;  /* first query of the tile, index within the sequence */
    int32_t nq;  /* queries in the tile */
    int32_t kvh; /* kv head */
} att_item;

typedef struct att_plan {
    att_item *items;    /* [n] */
    int64_t n;          /* items */
    work_range *ranges; /* [nr]: one per thread that may take items */
    int nr;
} att_plan;

/* Items of S sequences (query_start_loc qsl) for nh query and nkv kv heads, ranges for nr
 * threads; CPUD_OK, or CPUD_ENOMEM (then nothing to free). */
static inline int att_plan_new(const int32_t *qsl, int64_t S, int64_t nh, int64_t nkv, int nr,
                               att_plan *p) {
    const int64_t G = nh / nkv, tile = ATT_ROWS / G > 0 ? ATT_ROWS / G : 1;
    int64_t n = 0;
    for (int64_t s = 0; s < S; s++) n += nkv * ((qsl[s + 1] - qsl[s] + tile - 1) / tile);
    *p = (att_plan){NULL, n, NULL, nr};
    if (n == 0) return CPUD_OK;
    p->items = malloc(sizeof(att_item) * (size_t)n);
    p->ranges = p->items ? work_ranges_new(n, nr) : NULL;
    if (!p->ranges) {
        free(p->items);
        return CPUD_ENOMEM;
    }
    int64_t i = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t q_len = qsl[s + 1] - qsl[s];
        for (int64_t q0 = 0; q0 < q_len; q0 += tile)
            for (int64_t h = 0; h < nkv; h++)
                p->items[i++] = (att_item){(int32_t)s, (int32_t)q0,
                                           (int32_t)(q_len - q0 < tile ? q_len - q0 : tile),
                                           (int32_t)h};
    }
    return CPUD_OK;
}

/* Every item untaken again; no thread may be taking items meanwhile. */
static inline void att_plan_rearm(att_plan *p) {
    if (p->ranges) work_ranges_reset(p->ranges, p->n, p->nr);
}

static inline void att_plan_free(att_plan *p) {
    free(p->ranges);
    free(p->items);
    p->ranges = NULL;
    p->items = NULL;
}

#endif

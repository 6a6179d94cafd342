/* Shared-memory collectives between the ranks of one machine (cpud_native.h
 * describes the protocol).  Segment layout, all offsets from the mapping base:
 *
 *   0                      shm_header (written once by cpud_shm_init)
 *   64                     abort word: 0 = running, culprit + 2 once aborted
 *   128 + r * 128          shm_ctl of rank r (two cache lines: no false sharing,
 *                          also not with the adjacent-line prefetcher)
 *   data_off (4096-aligned) slot (r, b) at data_off + (2 r + b) * slot_bytes
 *
 * Only the owner of a control block or slot writes it; everyone reads. */
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <omp.h>

#include "common.h"
#include "shm.h"

#define SHM_MAGIC 0x316d687364757063ull /* "cpudshm1" */
#define SHM_VERSION 1u
#define SHM_LINE 64
#define SHM_CTL_OFF 128
#define SHM_CTL_STRIDE 128
#define SHM_PAGE 4096
#define SHM_MAX_SLOT (1ll << 40)
/* Waits: pause-spin this many times, then sched_yield, and once a wait is
 * older than SHM_SLEEP_AFTER_NS sleep SHM_SLEEP_NS per check. */
#define SHM_SPINS 2048
#define SHM_SLEEP_AFTER_NS 5000000ll
#define SHM_SLEEP_NS 20000l
#define SHM_LIVENESS_NS 20000000ll
/* Copies and sums below this many bytes stay on the calling thread. */
#define SHM_PAR_MIN_BYTES (256 << 10)
#define SHM_PAR_BLOCK 16384 /* elements per parallel work item */

enum { OP_BARRIER = 1, OP_ALL_REDUCE = 2, OP_GATHER = 3 };

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t world;
    uint64_t slot_bytes;
    uint64_t total_bytes;
} shm_header;

typedef struct {
    _Atomic uint64_t seq;     /* last round this rank published               */
    _Atomic uint64_t meta[2]; /* round g's op, element size and bytes: [g & 1] */
    _Atomic int32_t pid;      /* attached process, 0 before attach            */
} shm_ctl;

struct cpud_shm {
    char *base;
    int rank; /* -1: observer */
    int world;
    int64_t slot_bytes;
    uint64_t gen; /* rounds this rank has published */
    cpud_shm_sum_fn sum;
};

_Static_assert(sizeof(shm_header) <= SHM_LINE, "header fits one line");
_Static_assert(sizeof(shm_ctl) <= SHM_CTL_STRIDE, "control block fits its lines");

/* ------------------------------------------------------------------ layout */

static int64_t data_offset(int world) {
    const int64_t end = SHM_CTL_OFF + (int64_t)world * SHM_CTL_STRIDE;
    return (end + SHM_PAGE - 1) / SHM_PAGE * SHM_PAGE;
}

static _Atomic int64_t *abort_word(const cpud_shm *h) {
    return (_Atomic int64_t *)(h->base + SHM_LINE);
}

static shm_ctl *ctl(const cpud_shm *h, int r) {
    return (shm_ctl *)(h->base + SHM_CTL_OFF + (int64_t)r * SHM_CTL_STRIDE);
}

static char *slot(const cpud_shm *h, int r, uint64_t g) {
    return h->base + data_offset(h->world) + (2 * (int64_t)r + (int64_t)(g & 1)) * h->slot_bytes;
}

int64_t cpud_shm_segment_bytes(int world, int64_t slot_bytes) {
    if (world < 1 || world > CPUD_SHM_MAX_WORLD || slot_bytes < SHM_PAGE ||
        slot_bytes % SHM_PAGE || slot_bytes > SHM_MAX_SLOT)
        return -1;
    return data_offset(world) + 2 * (int64_t)world * slot_bytes;
}

int cpud_shm_init(intptr_t base, int64_t bytes, int world, int64_t slot_bytes) {
    const int64_t need = cpud_shm_segment_bytes(world, slot_bytes);
    if (!base || need < 0 || bytes < need) return CPUD_EARG;
    shm_header *hd = (shm_header *)base;
    hd->version = SHM_VERSION;
    hd->world = (uint32_t)world;
    hd->slot_bytes = (uint64_t)slot_bytes;
    hd->total_bytes = (uint64_t)need;
    atomic_store_explicit((_Atomic uint64_t *)&hd->magic, SHM_MAGIC, memory_order_release);
    return CPUD_OK;
}

/* ------------------------------------------------------------------ handle */

static cpud_shm_sum_fn sum_for(int isa) {
    if (isa < CPUD_ISA_SCALAR || isa > cpud_detect_isa()) return NULL;
    /* The avx512bf16 tier sums with the avx512 code: VCVTNEPS2BF16 treats
     * denormals as zero, the software rounding matches torch exactly. */
    if (isa >= CPUD_ISA_AVX512) return cpud_shm_sum_avx512;
    return isa == CPUD_ISA_AVX2 ? cpud_shm_sum_avx2 : cpud_shm_sum_scalar;
}

static int header_ok(const shm_header *hd, int64_t bytes, int world) {
    if (atomic_load_explicit((_Atomic uint64_t *)&hd->magic, memory_order_acquire) != SHM_MAGIC ||
        hd->version != SHM_VERSION || hd->world != (uint32_t)world)
        return 0;
    const int64_t need = cpud_shm_segment_bytes(world, (int64_t)hd->slot_bytes);
    return need > 0 && (uint64_t)need == hd->total_bytes && need <= bytes;
}

/* First touch of this rank's slots, from this rank (NUMA placement). */
static void prefault(const cpud_shm *h) {
    for (uint64_t b = 0; b < 2; b++)
        for (int64_t off = 0; off < h->slot_bytes; off += SHM_PAGE) slot(h, h->rank, b)[off] = 0;
}

cpud_shm *cpud_shm_open(intptr_t base, int64_t bytes, int rank, int world, int isa, int *err) {
    int dummy;
    if (!err) err = &dummy;
    *err = CPUD_EARG;
    if (!base || world < 1 || world > CPUD_SHM_MAX_WORLD || rank < -1 || rank >= world)
        return NULL;
    const cpud_shm_sum_fn sum = sum_for(isa);
    if (!sum) {
        *err = CPUD_EISA;
        return NULL;
    }
    const shm_header *hd = (const shm_header *)base;
    if (!header_ok(hd, bytes, world)) {
        *err = CPUD_EHEADER;
        return NULL;
    }
    cpud_shm *h = calloc(1, sizeof *h);
    if (!h) {
        *err = CPUD_ENOMEM;
        return NULL;
    }
    *h = (cpud_shm){.base = (char *)base, .rank = rank, .world = world,
                    .slot_bytes = (int64_t)hd->slot_bytes, .sum = sum};
    if (rank >= 0) {
        int32_t expected = 0;
        if (!atomic_compare_exchange_strong(&ctl(h, rank)->pid, &expected, (int32_t)getpid())) {
            free(h);
            *err = CPUD_EBUSY;
            return NULL;
        }
        prefault(h);
    }
    *err = CPUD_OK;
    return h;
}

void cpud_shm_close(cpud_shm *h) { free(h); }

int64_t cpud_shm_slot_bytes(const cpud_shm *h) { return h ? h->slot_bytes : -1; }

uint64_t cpud_shm_seq(const cpud_shm *h, int r) {
    if (!h || r < 0 || r >= h->world) return 0;
    return atomic_load_explicit(&ctl(h, r)->seq, memory_order_acquire);
}

int cpud_shm_pid(const cpud_shm *h, int r) {
    if (!h || r < 0 || r >= h->world) return 0;
    return atomic_load_explicit(&ctl(h, r)->pid, memory_order_relaxed);
}

void cpud_shm_abort(cpud_shm *h, int culprit) {
    if (!h) return;
    int64_t expected = 0;
    const int64_t word = (culprit >= 0 && culprit < h->world ? culprit : -1) + 2;
    atomic_compare_exchange_strong(abort_word(h), &expected, word);
}

int cpud_shm_abort_culprit(const cpud_shm *h) {
    if (!h) return -2;
    return (int)atomic_load_explicit(abort_word(h), memory_order_acquire) - 2;
}

/* ------------------------------------------------------------------- waits */

/* A process that no longer exists or is a zombie (exited, not yet reaped). */
static int pid_dead(int pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    char path[48], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0; /* no /proc: rely on kill() and the timeout */
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

typedef struct {
    int64_t start, timeout_ns, next_liveness;
    unsigned spins;
} shm_wait;

/* One poll of a wait that is still short of peer p: pause, yield or sleep;
 * returns 0 to keep waiting or an error for the wait to return. */
static int wait_step(const cpud_shm *h, shm_wait *w, int p, int *peer) {
    if (w->spins < SHM_SPINS) {
        w->spins++;
        _mm_pause();
        return 0;
    }
    const int64_t t = cpud_now_ns();
    if (!w->start) {
        w->start = t;
        w->next_liveness = t + SHM_LIVENESS_NS;
    }
    const int culprit = cpud_shm_abort_culprit(h);
    if (culprit != -2) {
        *peer = culprit;
        return CPUD_EABORTED;
    }
    if (w->timeout_ns > 0 && t - w->start >= w->timeout_ns) {
        *peer = p;
        return CPUD_ETIMEDOUT;
    }
    if (t >= w->next_liveness) {
        w->next_liveness = t + SHM_LIVENESS_NS;
        if (pid_dead(cpud_shm_pid(h, p))) {
            *peer = p;
            return CPUD_EPEERDEAD;
        }
    }
    if (t - w->start < SHM_SLEEP_AFTER_NS) {
        sched_yield();
    } else {
        const struct timespec nap = {0, SHM_SLEEP_NS};
        nanosleep(&nap, NULL);
    }
    return 0;
}

/* Waits until every peer published round g and checks that it ran the same
 * collective (meta); on failure sets *peer and aborts the group. */
static int wait_round(cpud_shm *h, uint64_t g, uint64_t meta, int64_t timeout_ns, int *peer) {
    shm_wait w = {.timeout_ns = timeout_ns};
    int rc = CPUD_OK;
    for (int p = 0; p < h->world && rc == CPUD_OK; p++) {
        if (p == h->rank) continue;
        while (rc == CPUD_OK && atomic_load_explicit(&ctl(h, p)->seq, memory_order_acquire) < g)
            rc = wait_step(h, &w, p, peer);
    }
    /* A member that failed may still have published this round: the abort
     * word, not the sequence counters, says whether the data is valid. */
    const int culprit = rc == CPUD_OK ? cpud_shm_abort_culprit(h) : -2;
    if (culprit != -2) {
        *peer = culprit;
        return CPUD_EABORTED;
    }
    for (int p = 0; p < h->world && rc == CPUD_OK; p++) {
        if (p != h->rank &&
            atomic_load_explicit(&ctl(h, p)->meta[g & 1], memory_order_relaxed) != meta) {
            *peer = p;
            rc = CPUD_EMISMATCH;
        }
    }
    if (rc != CPUD_OK && rc != CPUD_EABORTED) cpud_shm_abort(h, *peer);
    return rc;
}

/* ------------------------------------------------------------------ rounds */

static int par_ok(int64_t bytes) { return bytes >= SHM_PAR_MIN_BYTES && omp_get_max_threads() > 1; }

/* dst, src: [bytes] */
static void copy_bytes(char *dst, const char *src, int64_t bytes) {
    const int64_t block = (int64_t)SHM_PAR_BLOCK * 4;
    const int64_t nb = (bytes + block - 1) / block;
    CPUD_PAR_FOR(par_ok(bytes), b, nb,
        const int64_t off = b * block;
        memcpy(dst + off, src + off, (size_t)(bytes - off < block ? bytes - off : block));
        );
}

static uint64_t round_meta(int op, int elem_size, int64_t bytes) {
    return ((uint64_t)op << 56) | ((uint64_t)elem_size << 48) | (uint64_t)bytes;
}

/* Starts round g = ++gen: copies src [bytes] into this rank's slot (unless
 * src is NULL: nobody reads it), publishes, waits for every peer.  Returns
 * the round number, 0 on failure (rc in *rc). */
static uint64_t run_round(cpud_shm *h, uint64_t meta, const void *src, int64_t bytes,
                          int64_t timeout_ns, int *peer, int *rc) {
    const uint64_t g = ++h->gen;
    shm_ctl *me = ctl(h, h->rank);
    if (src && bytes) copy_bytes(slot(h, h->rank, g), (const char *)src, bytes);
    atomic_store_explicit(&me->meta[g & 1], meta, memory_order_relaxed);
    atomic_store_explicit(&me->seq, g, memory_order_release);
    *rc = wait_round(h, g, meta, timeout_ns, peer);
    return *rc == CPUD_OK ? g : 0;
}

static int member_ok(const cpud_shm *h, int *peer) {
    if (!h || h->rank < 0 || !peer) return 0;
    *peer = -1;
    return 1;
}

/* data [n] of dt += the other ranks' round-g slots, ranks in order. */
static void reduce_round(const cpud_shm *h, uint64_t g, int dt, char *data, int64_t n) {
    const void *src[CPUD_SHM_MAX_WORLD];
    for (int p = 0; p < h->world; p++) src[p] = p == h->rank ? data : slot(h, p, g);
    const int es = dtype_size(dt);
    const int64_t nb = (n + SHM_PAR_BLOCK - 1) / SHM_PAR_BLOCK;
    CPUD_PAR_FOR(par_ok(n * es * h->world), b, nb,
        const int64_t i0 = b * SHM_PAR_BLOCK, cnt = n - i0 < SHM_PAR_BLOCK ? n - i0 : SHM_PAR_BLOCK;
        const void *s[CPUD_SHM_MAX_WORLD];
        for (int p = 0; p < h->world; p++) s[p] = (const char *)src[p] + i0 * es;
        h->sum(dt, data + i0 * es, s, h->world, cnt);
        );
}

int cpud_shm_all_reduce(cpud_shm *h, int dtype, intptr_t data, int64_t n, int64_t timeout_ns,
                        int *peer) {
    if (!member_ok(h, peer) || (dtype != CPUD_F32 && dtype != CPUD_BF16) || !data || n < 0)
        return CPUD_EARG;
    const int es = dtype_size(dtype);
    const int64_t chunk = h->slot_bytes / es;
    char *p = (char *)data;
    for (int64_t i = 0; i < n; i += chunk) {
        const int64_t cnt = n - i < chunk ? n - i : chunk;
        int rc;
        const uint64_t g = run_round(h, round_meta(OP_ALL_REDUCE, es, cnt * es), p + i * es,
                                     cnt * es, timeout_ns, peer, &rc);
        if (!g) return rc;
        reduce_round(h, g, dtype, p + i * es, cnt);
    }
    return CPUD_OK;
}

/* Elements [e0, e0 + cnt) of rank p's [rows][cols] tensor (at src) into their
 * places in out [rows][world * cols]. */
static void scatter_cols(const cpud_shm *h, char *out, const char *src, int p, int64_t e0,
                         int64_t cnt, int64_t cols, int es) {
    for (int64_t e = e0, end = e0 + cnt; e < end;) {
        const int64_t r = e / cols, c = e % cols;
        const int64_t len = cols - c < end - e ? cols - c : end - e;
        memcpy(out + ((r * h->world + p) * cols + c) * es, src, (size_t)(len * es));
        src += len * es;
        e += len;
    }
}

int cpud_shm_gather_last_dim(cpud_shm *h, int elem_size, intptr_t data, int64_t rows,
                             int64_t cols, intptr_t out, int64_t timeout_ns, int *peer) {
    if (!member_ok(h, peer) || elem_size < 1 || elem_size > 16 || !data || rows < 0 ||
        cols < 1 || (h->rank == 0 && !out) || (rows > 0 && cols > INT64_MAX / rows))
        return CPUD_EARG;
    const int64_t n = rows * cols, chunk = h->slot_bytes / elem_size;
    const char *src = (const char *)data;
    for (int64_t e0 = 0; e0 < n; e0 += chunk) {
        const int64_t cnt = n - e0 < chunk ? n - e0 : chunk, bytes = cnt * elem_size;
        const char *mine = src + e0 * elem_size;
        int rc;
        const uint64_t g = run_round(h, round_meta(OP_GATHER, elem_size, bytes),
                                     h->rank == 0 ? NULL : mine, bytes, timeout_ns, peer, &rc);
        if (!g) return rc;
        if (h->rank != 0) continue;
        for (int p = 0; p < h->world; p++)
            scatter_cols(h, (char *)out, p == 0 ? mine : slot(h, p, g), p, e0, cnt, cols,
                         elem_size);
    }
    return CPUD_OK;
}

int cpud_shm_barrier(cpud_shm *h, int64_t timeout_ns, int *peer) {
    if (!member_ok(h, peer)) return CPUD_EARG;
    int rc;
    run_round(h, round_meta(OP_BARRIER, 0, 0), NULL, 0, timeout_ns, peer, &rc);
    return rc;
}

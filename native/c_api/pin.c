/* Thread pinning: every OpenMP thread of one parallel region pins itself to
 * its own CPU and reports where it runs.  libgomp keeps the threads of a
 * team alive for the next region of the same size started by the same
 * thread, so later regions (torch's included) run on the pinned threads. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>

#include <omp.h>

#include "cpud_native.h"

/* Pins the calling thread to cpu; returns sched_getcpu() or -2 on failure. */
static int pin_self(int cpu) {
    if (cpu < 0) return -2;
    cpu_set_t *set = CPU_ALLOC(cpu + 1);
    if (!set) return -2;
    const size_t size = CPU_ALLOC_SIZE(cpu + 1);
    CPU_ZERO_S(size, set);
    CPU_SET_S(cpu, size, set);
    const int rc = sched_setaffinity(0, size, set); /* 0 = this thread */
    CPU_FREE(set);
    return rc == 0 ? sched_getcpu() : -2;
}

int cpud_pin_threads(const int *cpus /* [n] */, int n, int *out_cpus /* [n] */) {
    if (n < 1) return 0;
    for (int i = 0; i < n; i++) out_cpus[i] = -1;
    int ran = 0;
#pragma omp parallel num_threads(n) reduction(+ : ran)
    {
        const int t = omp_get_thread_num();
        if (t < n) out_cpus[t] = pin_self(cpus[t]);
        ran = 1;
    }
    return ran;
}

int cpud_thread_cpus(int n, int *out_cpus /* [n] */) {
    if (n < 1) return 0;
    for (int i = 0; i < n; i++) out_cpus[i] = -1;
    int ran = 0;
#pragma omp parallel num_threads(n) reduction(+ : ran)
    {
        const int t = omp_get_thread_num();
        if (t < n) out_cpus[t] = sched_getcpu();
        ran = 1;
    }
    return ran;
}

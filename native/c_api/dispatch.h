#ifndef CPUD_DISPATCH_H
#define CPUD_DISPATCH_H

#include "common.h"

/* Kernel table of tier isa, or NULL when this CPU cannot run that tier. */
const cpud_ops *cpud_ops_for(int isa);

/* bit 0: AVX-VNNI, bit 1: AVX512-VNNI, as detected at load. */
int cpud_vnni_bits(void);

#endif

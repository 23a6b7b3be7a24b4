/* A FAKE CUDA driver for the agent's GPU memory load tests: no GPU, no memory taken.
 * It hands out made-up device addresses and counts bytes against a limit read from
 * FAKE_CUDA_MEMORY_MIB at cuCtxCreate (else FAKE_DEFAULT_MIB, 1000 unless built with
 * -DFAKE_DEFAULT_MIB=N: the agent's load worker runs with an empty environment),
 * answering CUDA_ERROR_OUT_OF_MEMORY (2) past it, as a MIG slice's driver does.
 * fake_cuda_outstanding() and fake_cuda_contexts() let a test see that everything was
 * freed and destroyed. Test-only: never in a tenant's image (make-fake-cuda-image.sh
 * builds a test image with it, for check 4's GPU half without a GPU). */
#include <stddef.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

static unsigned long long limit_bytes;
static unsigned long long used_bytes;
static unsigned long long next_ptr = 0x100000000ull;
static int contexts;
static int ctx_token;

#ifndef FAKE_DEFAULT_MIB
#define FAKE_DEFAULT_MIB 1000
#endif
#define MAX_ALLOCS 4096
static CUdeviceptr ptrs[MAX_ALLOCS];
static size_t sizes[MAX_ALLOCS];

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *d = 0;
    return 0;
}
CUresult cuCtxCreate_v2(void **ctx, unsigned flags, CUdevice d) {
    (void)flags; (void)d;
    const char *mib = getenv("FAKE_CUDA_MEMORY_MIB");
    limit_bytes = (unsigned long long)(mib ? strtoull(mib, NULL, 10) : FAKE_DEFAULT_MIB) << 20;
    contexts++;
    *ctx = &ctx_token;
    return 0;
}
CUresult cuCtxDestroy_v2(void *ctx) { (void)ctx; contexts--; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t n) {
    if (n == 0) return 1;
    if (used_bytes + n > limit_bytes) return 2;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (ptrs[i] == 0) {
            ptrs[i] = next_ptr;
            sizes[i] = n;
            next_ptr += n;
            used_bytes += n;
            *ptr = ptrs[i];
            return 0;
        }
    }
    return 2;
}
CUresult cuMemFree_v2(CUdeviceptr ptr) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (ptrs[i] == ptr) {
            used_bytes -= sizes[i];
            ptrs[i] = 0;
            return 0;
        }
    }
    return 1;
}
unsigned long long fake_cuda_outstanding(void) { return used_bytes; }
int fake_cuda_contexts(void) { return contexts; }

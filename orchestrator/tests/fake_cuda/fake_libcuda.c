/*
 * FAKE CUDA driver, for tests only: implements the CUDA driver API entry points that
 * tenantvm's GPU scrub uses, over host memory. One device of FAKE_TOTAL bytes, of which
 * FAKE_RESERVED are never allocatable (the driver's own share) and allocations beyond
 * FAKE_TOTAL - FAKE_RESERVED - FAKE_FRAGMENTED fail with CUDA_ERROR_OUT_OF_MEMORY although
 * cuMemGetInfo reports them free (fragmentation). Fresh allocations hold 0xA5 bytes: the
 * previous tenant's residue. Built with -DFAKE_MEMSET_SKIPS_A_BYTE, cuMemsetD8 leaves the
 * middle byte of each range untouched, so the scrub's read-back must catch it. Built with
 * -DFAKE_ALLOC_LIMIT=N, no more than N bytes are ever allocatable although cuMemGetInfo
 * reports the rest free: the scrub zeroes (and reads back) only part of the device, and
 * must say it did not cover it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_TOTAL (96ull << 20)
#define FAKE_RESERVED (4ull << 20)
#define FAKE_FRAGMENTED (3ull << 20)
#define MAX_ALLOCS 256

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

static struct { void *p; size_t n; } allocs[MAX_ALLOCS];
static size_t used;
static int ctx_token;

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *d = 0;
    return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    (void)d;
    strncpy(name, "FAKE GPU for tests", (size_t)len - 1);
    name[len - 1] = 0;
    return 0;
}
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice d) {
    (void)d;
    memset(uuid, 0x11, 16);
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { (void)d; *bytes = FAKE_TOTAL; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)d;
    if (attr == 36) { *v = 1000000; return 0; } /* memory clock, kHz */
    if (attr == 37) { *v = 256; return 0; }     /* bus width, bits */
    return 1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) { (void)d; *ctx = &ctx_token; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    *free_bytes = FAKE_TOTAL - FAKE_RESERVED - used;
    *total = FAKE_TOTAL;
    return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t n) {
    if (n == 0) return 1;
    if (used + n > FAKE_TOTAL - FAKE_RESERVED - FAKE_FRAGMENTED) return 2; /* OUT_OF_MEMORY */
#ifdef FAKE_ALLOC_LIMIT
    if (used + n > (size_t)(FAKE_ALLOC_LIMIT)) return 2;
#endif
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].p == NULL) {
            void *p = malloc(n);
            if (p == NULL) return 2;
            memset(p, 0xA5, n);
            allocs[i].p = p;
            allocs[i].n = n;
            used += n;
            *ptr = (CUdeviceptr)(uintptr_t)p;
            return 0;
        }
    }
    return 2;
}
CUresult cuMemFree_v2(CUdeviceptr ptr) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].p == (void *)(uintptr_t)ptr) {
            free(allocs[i].p);
            used -= allocs[i].n;
            allocs[i].p = NULL;
            return 0;
        }
    }
    return 1;
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    unsigned char *p = (unsigned char *)(uintptr_t)dst;
#ifdef FAKE_MEMSET_SKIPS_A_BYTE
    unsigned char keep = p[n / 2];
    memset(p, v, n);
    p[n / 2] = keep;
#else
    memset(p, v, n);
#endif
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return 0;
}
CUresult cuMemAllocHost_v2(void **p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) {
    *s = e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE";
    return 0;
}

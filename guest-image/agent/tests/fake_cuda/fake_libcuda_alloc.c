/* A FAKE CUDA driver for the agent's GPU memory load tests: no GPU, no memory taken.
 * It hands out made-up device addresses and counts bytes against a limit read from
 * FAKE_CUDA_MEMORY_MIB at cuCtxCreate (else FAKE_DEFAULT_MIB, 1000 unless built with
 * -DFAKE_DEFAULT_MIB=N: the agent's load worker runs with an empty environment),
 * answering CUDA_ERROR_OUT_OF_MEMORY (2) past it, as a MIG slice's driver does.
 * fake_cuda_outstanding() and fake_cuda_contexts() let a test see that everything was
 * freed and destroyed. For the compute load it loads a module only from PTX text that
 * defines the kernel `tenantvm_spin`, checks each launch's arguments (256 threads per
 * block, a rounds count, an allocated output address), counts launches, blocks and
 * multiply-adds (fake_cuda_launches(), fake_cuda_blocks(), fake_cuda_fmas()) and makes
 * each launch take FAKE_CUDA_LAUNCH_US microseconds (default 1000) at cuCtxSynchronize. Test-only: never in a tenant's image (make-fake-cuda-image.sh
 * builds a test image with it, for check 4's GPU half without a GPU). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
static int modules;
static int module_token, function_token;
static unsigned long long launches, blocks_run, fmas, pending;

CUresult cuModuleLoadData(void **module, const void *image) {
    const char *ptx = image;
    if (!ptx || !strstr(ptx, ".entry tenantvm_spin(") || !strstr(ptx, "fma.rn.f32"))
        return 218; /* CUDA_ERROR_INVALID_PTX */
    modules++;
    *module = &module_token;
    return 0;
}
CUresult cuModuleGetFunction(void **f, void *module, const char *name) {
    if (module != &module_token) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    if (strcmp(name, "tenantvm_spin") != 0) return 500; /* CUDA_ERROR_NOT_FOUND */
    *f = &function_token;
    return 0;
}
CUresult cuModuleUnload(void *module) {
    if (module != &module_token) return 400;
    modules--;
    return 0;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream,
                        void **params, void **extra) {
    (void)stream;
    if (f != &function_token || extra || shmem) return 1;
    if (gx == 0 || gy != 1 || gz != 1 || bx != 256 || by != 1 || bz != 1 || !params) return 1;
    unsigned rounds = *(unsigned *)params[0];
    CUdeviceptr out = *(CUdeviceptr *)params[1];
    int found = 0;
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (ptrs[i] == out && sizes[i] >= 256 * 4) found = 1;
    if (!found || rounds == 0) return 1;
    launches++;
    blocks_run += gx;
    fmas += (unsigned long long)gx * 256 * rounds * 8;
    pending++;
    return 0;
}
CUresult cuCtxSynchronize(void) {
    const char *us = getenv("FAKE_CUDA_LAUNCH_US");
    if (pending) usleep((useconds_t)(us ? strtoul(us, NULL, 10) : 1000) * pending);
    pending = 0;
    return 0;
}
unsigned long long fake_cuda_launches(void) { return launches; }
unsigned long long fake_cuda_blocks(void) { return blocks_run; }
unsigned long long fake_cuda_fmas(void) { return fmas; }
int fake_cuda_modules(void) { return modules; }
unsigned long long fake_cuda_outstanding(void) { return used_bytes; }
int fake_cuda_contexts(void) { return contexts; }

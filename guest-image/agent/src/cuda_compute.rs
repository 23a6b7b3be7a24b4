//! The `gpu-compute` test load: keeps device 0 busy through the CUDA driver API, loaded at
//! run time like the memory load ([`crate::cuda`]). A small PTX kernel (text, compiled by
//! the driver's JIT for whatever GPU the guest has) runs chains of fused multiply-adds in
//! every thread; [`spin`] launches it again as soon as the last launch ends, until the
//! deadline, and reports the multiply-adds done. `tenantvm verify` check 8 reads that rate
//! in a victim slice, idle and while its neighbour's slice is saturated the same way.

use std::ffi::{c_char, c_uint, c_void, CString};
use std::time::{Duration, Instant};

use crate::cuda::{check, Context, CuResult, Cuda, CudaError};

/// The kernel's name in [`PTX`].
pub const KERNEL: &str = "tenantvm_spin";
/// Threads per block.
pub const BLOCK_THREADS: u32 = 256;
/// Loop rounds per thread and launch; each round is [`FMAS_PER_ROUND`] multiply-adds.
pub const ROUNDS: u32 = 4096;
/// Multiply-adds per round of the kernel's loop.
pub const FMAS_PER_ROUND: u64 = 8;

/// The kernel: each thread runs `rounds` rounds of eight dependent single-precision
/// multiply-adds on a value seeded from its thread index, then stores it (so that no
/// compiler drops the loop) at `out[threadIdx.x]`. PTX ISA 6.0 for sm_50: the driver's JIT
/// compiles it for any later GPU.
pub const PTX: &str = r#".version 6.0
.target sm_50
.address_size 64

.visible .entry tenantvm_spin(
	.param .u32 tenantvm_spin_rounds,
	.param .u64 tenantvm_spin_out
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<4>;
	.reg .f32 	%f<3>;
	.reg .b64 	%rd<4>;

	ld.param.u32 	%r1, [tenantvm_spin_rounds];
	ld.param.u64 	%rd1, [tenantvm_spin_out];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r2, %tid.x;
	cvt.rn.f32.u32 	%f1, %r2;
	mov.f32 	%f2, 0f3F7FFFEF;
	mov.u32 	%r3, 0;
LOOP:
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	fma.rn.f32 	%f1, %f1, %f2, 0f3A83126F;
	add.u32 	%r3, %r3, 1;
	setp.lt.u32 	%p1, %r3, %r1;
	@%p1 bra 	LOOP;
	mul.wide.u32 	%rd3, %r2, 4;
	add.s64 	%rd3, %rd2, %rd3;
	st.global.f32 	[%rd3], %f1;
	ret;
}
"#;

/// `CUmodule` and `CUfunction`: opaque.
type Handle = *mut c_void;

type ModuleLoadData = unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult;
type ModuleGetFunction = unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult;
type ModuleUnload = unsafe extern "C" fn(Handle) -> CuResult;
#[allow(clippy::type_complexity)]
type LaunchKernel = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;
type CtxSynchronize = unsafe extern "C" fn() -> CuResult;

/// The kernel loaded into a context, with the entry points that launch it. The module is
/// unloaded on drop (before its context, which it borrows).
pub struct Kernel<'c, 'a> {
    _ctx: &'c Context<'a>,
    module: Handle,
    function: Handle,
    unload: ModuleUnload,
    launch: LaunchKernel,
    synchronize: CtxSynchronize,
}

impl<'c, 'a> Kernel<'c, 'a> {
    /// Loads [`PTX`] into `ctx` (current on this thread) and finds [`KERNEL`].
    pub fn load(cuda: &Cuda, ctx: &'c Context<'a>) -> Result<Self, CudaError> {
        // SAFETY: (all five transmutes) each symbol is the named CUDA driver API function,
        // whose C prototype (cuda.h) matches the type it becomes; they are called only while
        // the driver stays loaded (`cuda` outlives `ctx`, which outlives this value).
        let (load_data, get_function, unload, launch, synchronize) = unsafe {
            (
                std::mem::transmute::<*mut c_void, ModuleLoadData>(
                    cuda.symbol("cuModuleLoadData")?,
                ),
                std::mem::transmute::<*mut c_void, ModuleGetFunction>(
                    cuda.symbol("cuModuleGetFunction")?,
                ),
                std::mem::transmute::<*mut c_void, ModuleUnload>(cuda.symbol("cuModuleUnload")?),
                std::mem::transmute::<*mut c_void, LaunchKernel>(cuda.symbol("cuLaunchKernel")?),
                std::mem::transmute::<*mut c_void, CtxSynchronize>(
                    cuda.symbol("cuCtxSynchronize")?,
                ),
            )
        };
        let image = CString::new(PTX).map_err(|_| CudaError::Name("the PTX text".into()))?;
        let mut module: Handle = std::ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer and `image` a NUL-terminated PTX text, as
        // cuModuleLoadData wants; the context made current by `ctx` receives the module.
        check("cuModuleLoadData", unsafe {
            load_data(&mut module, image.as_ptr().cast())
        })?;
        let name = CString::new(KERNEL).map_err(|_| CudaError::Name(KERNEL.into()))?;
        let mut function: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer, the module just loaded, a valid C string.
        let found = check("cuModuleGetFunction", unsafe {
            get_function(&mut function, module, name.as_ptr())
        });
        if let Err(e) = found {
            // SAFETY: the module loaded above, unloaded once.
            unsafe { unload(module) };
            return Err(e);
        }
        Ok(Kernel {
            _ctx: ctx,
            module,
            function,
            unload,
            launch,
            synchronize,
        })
    }

    /// One launch of `blocks` blocks of [`BLOCK_THREADS`] threads, each running `rounds`
    /// rounds and storing into `out` (at least [`BLOCK_THREADS`] floats), waited for.
    pub fn run(&self, blocks: u32, rounds: u32, out: u64) -> Result<(), CudaError> {
        let mut rounds = rounds;
        let mut out = out;
        let mut params: [*mut c_void; 2] = [
            (&mut rounds as *mut u32).cast(),
            (&mut out as *mut u64).cast(),
        ];
        // SAFETY: the function belongs to this module, loaded in the current context; the
        // parameter array points at two live locals whose types match the kernel's
        // `.param .u32` and `.param .u64`; no shared memory, the default stream, no extra.
        check("cuLaunchKernel", unsafe {
            (self.launch)(
                self.function,
                blocks,
                1,
                1,
                BLOCK_THREADS,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: no arguments; waits for the launch above in the current context.
        check("cuCtxSynchronize", unsafe { (self.synchronize)() })
    }
}

impl Drop for Kernel<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: the module loaded in `load`, unloaded once; no launch is in flight (each
        // `run` waits for its launch).
        let _ = unsafe { (self.unload)(self.module) };
    }
}

/// Multiply-adds one launch of `blocks` blocks does.
pub fn fmas_per_launch(blocks: u32) -> u64 {
    u64::from(blocks) * u64::from(BLOCK_THREADS) * u64::from(ROUNDS) * FMAS_PER_ROUND
}

/// Launches the kernel on device 0 of `library`'s driver, `blocks` blocks at a time, until
/// `wall` has passed; `progress` gets the millions of multiply-adds done so far, at most
/// every quarter second and once at the end. Returns the launches done.
pub fn spin(
    library: &str,
    blocks: u32,
    wall: Duration,
    mut progress: impl FnMut(u64),
) -> Result<u64, CudaError> {
    let cuda = Cuda::open(library)?;
    let mut ctx = cuda.context(0)?;
    let out = ctx
        .alloc_at(u64::from(BLOCK_THREADS) * 4)?
        .ok_or(CudaError::Call {
            call: "cuMemAlloc_v2",
            code: crate::cuda::CUDA_ERROR_OUT_OF_MEMORY,
        })?;
    let kernel = Kernel::load(&cuda, &ctx)?;
    let deadline = Instant::now() + wall;
    let mut next_report = Instant::now();
    let mut launches: u64 = 0;
    while Instant::now() < deadline {
        kernel.run(blocks, ROUNDS, out)?;
        launches += 1;
        if Instant::now() >= next_report {
            progress(launches * fmas_per_launch(blocks) / 1_000_000);
            next_report = Instant::now() + Duration::from_millis(250);
        }
    }
    progress(launches * fmas_per_launch(blocks) / 1_000_000);
    drop(kernel);
    ctx.free_all();
    Ok(launches)
}

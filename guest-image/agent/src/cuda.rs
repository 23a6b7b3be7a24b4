//! The few CUDA driver API entry points the `gpu-memory` test load needs, loaded from
//! `libcuda.so.1` at run time with `dlopen` (no link-time CUDA dependency: an image without
//! the NVIDIA driver still builds and runs, and the load then says plainly that there is no
//! driver). [`Cuda::open`] resolves the symbols, [`Cuda::context`] creates a context on a
//! device, and [`fill`] allocates device memory in chunks until the driver answers out of
//! memory (or a cap is reached), which is how `tenantvm verify` check 4 measures what a
//! tenant's GPU slice really lets it take. [`crate::cuda_compute`] adds the module and
//! launch entry points the `gpu-compute` load needs.

use std::ffi::{c_int, c_uint, c_void, CStr, CString};

/// The driver library's name in the guest.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";
/// The first (largest) allocation chunk.
pub const FIRST_CHUNK: u64 = 256 << 20;
/// The smallest chunk tried before the memory is judged full.
pub const MIN_CHUNK: u64 = 1 << 20;

/// `CUresult`: 0 is success.
pub type CuResult = c_int;
/// `CUDA_SUCCESS`.
const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUdevice`: an ordinal.
type CuDevice = c_int;
/// `CUcontext`: opaque.
type CuContext = *mut c_void;
/// `CUdeviceptr`: a device address.
pub type CuDevicePtr = u64;

/// Why the CUDA driver could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `dlopen` failed: no CUDA driver in this guest (or not loadable from here).
    #[error("no CUDA driver in the guest: cannot load {library}: {reason}")]
    Missing {
        /// The library asked for.
        library: String,
        /// `dlerror`'s text.
        reason: String,
    },
    /// The library lacks an entry point.
    #[error("{library} has no {symbol}: not a CUDA driver this load can use")]
    Symbol {
        /// The library.
        library: String,
        /// The missing symbol.
        symbol: &'static str,
    },
    /// A driver call failed.
    #[error("{call} failed with CUDA error {code}")]
    Call {
        /// The call.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
    },
    /// The library name held a NUL byte.
    #[error("bad library name {0:?}")]
    Name(String),
}

/// The loaded driver and its entry points. The handle is closed on drop, after which no
/// pointer below is used (they are private and only called through `&self`).
pub struct Cuda {
    handle: *mut c_void,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut CuContext, c_uint, CuDevice) -> CuResult,
    ctx_destroy: unsafe extern "C" fn(CuContext) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
}

fn dl_error() -> String {
    // SAFETY: dlerror takes no arguments and returns NULL or a NUL-terminated string owned
    // by the C library, valid until the next dl* call on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "unknown dlopen error".into();
    }
    // SAFETY: `p` is non-NULL and NUL-terminated (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub(crate) fn check(call: &'static str, code: CuResult) -> Result<(), CudaError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Call { call, code })
    }
}

impl Cuda {
    /// Loads `library` (normally [`CUDA_LIBRARY`]), resolves the entry points and calls
    /// `cuInit(0)`.
    pub fn open(library: &str) -> Result<Cuda, CudaError> {
        let c_name = CString::new(library).map_err(|_| CudaError::Name(library.into()))?;
        // SAFETY: `c_name` is a valid NUL-terminated string; dlopen runs the library's
        // initialisers, which (for the NVIDIA driver, or a test's fake) have no
        // preconditions on this process. A NULL result is handled below.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(CudaError::Missing {
                library: library.into(),
                reason: dl_error(),
            });
        }
        let sym = |name: &'static str| -> Result<*mut c_void, CudaError> {
            let c = CString::new(name).map_err(|_| CudaError::Name(name.into()))?;
            // SAFETY: `handle` is a live handle from dlopen above and `c` a valid C string.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                Err(CudaError::Symbol {
                    library: library.into(),
                    symbol: name,
                })
            } else {
                Ok(p)
            }
        };
        let resolved = (|| {
            Ok::<_, CudaError>((
                sym("cuInit")?,
                sym("cuDeviceGet")?,
                sym("cuCtxCreate_v2")?,
                sym("cuCtxDestroy_v2")?,
                sym("cuMemAlloc_v2")?,
                sym("cuMemFree_v2")?,
            ))
        })();
        let (init, device_get, ctx_create, ctx_destroy, mem_alloc, mem_free) = match resolved {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: `handle` came from dlopen and nothing resolved from it is kept.
                unsafe { libc::dlclose(handle) };
                return Err(e);
            }
        };
        // SAFETY: (all six transmutes) each pointer is the named CUDA driver API function,
        // whose C prototype (cuda.h) matches the function pointer type it becomes; they are
        // only called while `handle` stays open (closed in Drop).
        let cuda = unsafe {
            Cuda {
                handle,
                init: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_uint) -> CuResult>(
                    init,
                ),
                device_get: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
                >(device_get),
                ctx_create: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CuContext, c_uint, CuDevice) -> CuResult,
                >(ctx_create),
                ctx_destroy: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(CuContext) -> CuResult,
                >(ctx_destroy),
                mem_alloc: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
                >(mem_alloc),
                mem_free: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(CuDevicePtr) -> CuResult,
                >(mem_free),
            }
        };
        // SAFETY: cuInit takes a flags word that must be 0.
        check("cuInit", unsafe { (cuda.init)(0) })?;
        Ok(cuda)
    }

    /// Creates a context on device `ordinal` and makes it current on this thread.
    pub fn context(&self, ordinal: i32) -> Result<Context<'_>, CudaError> {
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer for the duration of the call.
        check("cuDeviceGet", unsafe {
            (self.device_get)(&mut dev, ordinal)
        })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; flags 0 is the default scheduling mode;
        // `dev` came from cuDeviceGet.
        check("cuCtxCreate_v2", unsafe {
            (self.ctx_create)(&mut ctx, 0, dev)
        })?;
        Ok(Context {
            cuda: self,
            ctx,
            held: Vec::new(),
        })
    }
}

impl Cuda {
    /// Resolves `name` in the loaded driver (for entry points only some loads need).
    pub(crate) fn symbol(&self, name: &'static str) -> Result<*mut c_void, CudaError> {
        let c = CString::new(name).map_err(|_| CudaError::Name(name.into()))?;
        // SAFETY: `self.handle` is open for as long as `self` lives; `c` is a valid C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        if p.is_null() {
            Err(CudaError::Symbol {
                library: "the CUDA driver".into(),
                symbol: name,
            })
        } else {
            Ok(p)
        }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: `handle` came from dlopen and is closed once; every Context borrowing
        // this driver has been dropped (the borrow checker sees to that).
        unsafe { libc::dlclose(self.handle) };
    }
}

/// A CUDA context and the device memory allocated in it; both are freed on drop.
pub struct Context<'a> {
    cuda: &'a Cuda,
    ctx: CuContext,
    held: Vec<(CuDevicePtr, u64)>,
}

impl Context<'_> {
    /// Allocates `bytes`: `Ok(true)` when it got them, `Ok(false)` when the driver answered
    /// out of memory.
    pub fn alloc(&mut self, bytes: u64) -> Result<bool, CudaError> {
        self.alloc_at(bytes).map(|p| p.is_some())
    }

    /// Allocates `bytes` and returns their device address (`None`: out of memory); freed
    /// with the rest of the context's memory.
    pub fn alloc_at(&mut self, bytes: u64) -> Result<Option<CuDevicePtr>, CudaError> {
        let size = usize::try_from(bytes).map_err(|_| CudaError::Call {
            call: "cuMemAlloc_v2",
            code: CUDA_ERROR_OUT_OF_MEMORY,
        })?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: `ptr` is a valid out-pointer; this thread's current context is `self.ctx`
        // (cuCtxCreate made it current and nothing else changes it).
        match unsafe { (self.cuda.mem_alloc)(&mut ptr, size) } {
            CUDA_SUCCESS => {
                self.held.push((ptr, bytes));
                Ok(Some(ptr))
            }
            CUDA_ERROR_OUT_OF_MEMORY => Ok(None),
            code => Err(CudaError::Call {
                call: "cuMemAlloc_v2",
                code,
            }),
        }
    }

    /// Bytes held now.
    pub fn held_bytes(&self) -> u64 {
        self.held.iter().map(|(_, n)| n).sum()
    }

    /// Frees everything held.
    pub fn free_all(&mut self) {
        for (ptr, _) in self.held.drain(..) {
            // SAFETY: `ptr` was returned by cuMemAlloc in this context and is freed once.
            let _ = unsafe { (self.cuda.mem_free)(ptr) };
        }
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        self.free_all();
        // SAFETY: `ctx` was created by cuCtxCreate and is destroyed once, after its
        // allocations were freed.
        let _ = unsafe { (self.cuda.ctx_destroy)(self.ctx) };
    }
}

/// Allocates in `ctx` until the driver answers out of memory or `cap` bytes are held:
/// chunks of [`FIRST_CHUNK`], halved at each out-of-memory answer down to [`MIN_CHUNK`].
/// `progress` is called with the bytes held after each allocation. Returns the bytes held.
pub fn fill(
    ctx: &mut Context<'_>,
    cap: u64,
    mut progress: impl FnMut(u64),
) -> Result<u64, CudaError> {
    let mut chunk = FIRST_CHUNK;
    loop {
        let held = ctx.held_bytes();
        if held >= cap {
            return Ok(held);
        }
        let want = chunk.min(cap - held);
        if ctx.alloc(want)? {
            progress(ctx.held_bytes());
        } else if chunk > MIN_CHUNK {
            chunk /= 2;
        } else {
            return Ok(held);
        }
    }
}

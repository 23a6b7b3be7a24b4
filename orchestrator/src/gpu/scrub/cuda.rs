//! The few CUDA driver API entry points the scrub needs, loaded from `libcuda.so.1` at run time
//! (no build-time CUDA dependency; hosts without the driver get a clear error).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, OsStr};

use libloading::Library;

use super::ScrubError;

/// `CUresult`: 0 is success.
type CuResult = c_int;
/// `CUdevice`: an ordinal.
pub(crate) type CuDevice = c_int;
/// `CUcontext`: opaque.
pub(crate) type CuContext = *mut c_void;
/// `CUdeviceptr`: a device address (`unsigned long long`).
pub(crate) type CuDevicePtr = u64;

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
/// `CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE` (kHz).
pub(crate) const ATTR_MEMORY_CLOCK_KHZ: c_int = 36;
/// `CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH` (bits).
pub(crate) const ATTR_MEMORY_BUS_BITS: c_int = 37;

/// The driver library and the entry points used, resolved once.
pub(crate) struct CudaDriver {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut [u8; 16], CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memset_d8: unsafe extern "C" fn(CuDevicePtr, u8, usize) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    mem_alloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    // Declared last so that it is dropped after nothing can call through the pointers above.
    _lib: Library,
}

macro_rules! sym {
    ($lib:expr, $name:literal) => {{
        // SAFETY: the symbol is a CUDA driver API function whose C prototype matches the field
        // type it is assigned to (see cuda.h); the pointer is only used while `_lib` is loaded.
        let s = unsafe { $lib.get($name) }.map_err(|e| ScrubError::DriverSymbol {
            symbol: String::from_utf8_lossy(&$name[..$name.len() - 1]).into_owned(),
            reason: e.to_string(),
        })?;
        *s
    }};
}

impl CudaDriver {
    /// Loads `libcuda.so.1` (or `name`) and resolves the entry points, then calls `cuInit`.
    pub(crate) fn load(name: &OsStr) -> Result<Self, ScrubError> {
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which have no
        // preconditions on this process.
        let lib = unsafe { Library::new(name) }.map_err(|e| ScrubError::DriverMissing {
            library: name.to_string_lossy().into_owned(),
            reason: e.to_string(),
        })?;
        let driver = CudaDriver {
            init: sym!(lib, b"cuInit\0"),
            driver_get_version: sym!(lib, b"cuDriverGetVersion\0"),
            device_get_count: sym!(lib, b"cuDeviceGetCount\0"),
            device_get: sym!(lib, b"cuDeviceGet\0"),
            device_get_name: sym!(lib, b"cuDeviceGetName\0"),
            // _v2 reports a MIG instance's own UUID (CUDA 11.4+).
            device_get_uuid: sym!(lib, b"cuDeviceGetUuid_v2\0"),
            device_total_mem: sym!(lib, b"cuDeviceTotalMem_v2\0"),
            device_get_attribute: sym!(lib, b"cuDeviceGetAttribute\0"),
            primary_ctx_retain: sym!(lib, b"cuDevicePrimaryCtxRetain\0"),
            primary_ctx_release: sym!(lib, b"cuDevicePrimaryCtxRelease_v2\0"),
            ctx_set_current: sym!(lib, b"cuCtxSetCurrent\0"),
            ctx_synchronize: sym!(lib, b"cuCtxSynchronize\0"),
            mem_get_info: sym!(lib, b"cuMemGetInfo_v2\0"),
            mem_alloc: sym!(lib, b"cuMemAlloc_v2\0"),
            mem_free: sym!(lib, b"cuMemFree_v2\0"),
            memset_d8: sym!(lib, b"cuMemsetD8_v2\0"),
            memcpy_dtoh: sym!(lib, b"cuMemcpyDtoH_v2\0"),
            mem_alloc_host: sym!(lib, b"cuMemAllocHost_v2\0"),
            mem_free_host: sym!(lib, b"cuMemFreeHost\0"),
            get_error_name: sym!(lib, b"cuGetErrorName\0"),
            _lib: lib,
        };
        // SAFETY: cuInit takes a flags word that must be 0.
        driver.check("cuInit", unsafe { (driver.init)(0) })?;
        Ok(driver)
    }

    fn error_name(&self, rc: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string into `name`.
        let ok = unsafe { (self.get_error_name)(rc, &mut name) } == 0 && !name.is_null();
        if ok {
            // SAFETY: the driver returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUDA error {rc}")
        }
    }

    pub(crate) fn check(&self, call: &'static str, rc: CuResult) -> Result<(), ScrubError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(ScrubError::Cuda {
                call,
                code: rc,
                name: self.error_name(rc),
            })
        }
    }

    pub(crate) fn driver_version(&self) -> Result<c_int, ScrubError> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check("cuDriverGetVersion", unsafe {
            (self.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    pub(crate) fn device_count(&self) -> Result<c_int, ScrubError> {
        let mut n = 0;
        // SAFETY: writes one int.
        self.check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    pub(crate) fn device(&self, ordinal: c_int) -> Result<CuDevice, ScrubError> {
        let mut d = 0;
        // SAFETY: writes one CUdevice; the driver checks the ordinal.
        self.check("cuDeviceGet", unsafe { (self.device_get)(&mut d, ordinal) })?;
        Ok(d)
    }

    pub(crate) fn device_name(&self, dev: CuDevice) -> Result<String, ScrubError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        self.check("cuDeviceGetName", unsafe {
            (self.device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        // SAFETY: NUL-terminated within `buf` (the driver truncates to len - 1).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    pub(crate) fn device_uuid(&self, dev: CuDevice) -> Result<[u8; 16], ScrubError> {
        let mut uuid = [0u8; 16];
        // SAFETY: CUuuid is 16 bytes; the driver writes exactly that.
        self.check("cuDeviceGetUuid_v2", unsafe {
            (self.device_get_uuid)(&mut uuid, dev)
        })?;
        Ok(uuid)
    }

    pub(crate) fn total_mem(&self, dev: CuDevice) -> Result<usize, ScrubError> {
        let mut bytes = 0usize;
        // SAFETY: writes one size_t.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.device_total_mem)(&mut bytes, dev)
        })?;
        Ok(bytes)
    }

    pub(crate) fn attribute(&self, attr: c_int, dev: CuDevice) -> Result<c_int, ScrubError> {
        let mut v = 0;
        // SAFETY: writes one int; the driver validates `attr`.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// Retains the device's primary context and makes it current on this thread.
    pub(crate) fn enter(&self, dev: CuDevice) -> Result<(), ScrubError> {
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, dev)
        })?;
        // SAFETY: `ctx` was just returned by the driver.
        let set = unsafe { (self.ctx_set_current)(ctx) };
        if set != 0 {
            // SAFETY: balances the retain above.
            unsafe { (self.primary_ctx_release)(dev) };
        }
        self.check("cuCtxSetCurrent", set)
    }

    /// Releases the primary context retained by [`CudaDriver::enter`].
    pub(crate) fn leave(&self, dev: CuDevice) {
        // SAFETY: detaching the current context and releasing one retain of the primary context.
        unsafe {
            (self.ctx_set_current)(std::ptr::null_mut());
            (self.primary_ctx_release)(dev);
        }
    }

    pub(crate) fn synchronize(&self) -> Result<(), ScrubError> {
        // SAFETY: no arguments; needs a current context, which `enter` set.
        self.check("cuCtxSynchronize", unsafe { (self.ctx_synchronize)() })
    }

    pub(crate) fn mem_info(&self) -> Result<(usize, usize), ScrubError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t values.
        self.check("cuMemGetInfo_v2", unsafe {
            (self.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// Allocates `bytes` of device memory; `Ok(None)` when the device is out of memory.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<Option<CuDevicePtr>, ScrubError> {
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: writes one device pointer.
        let rc = unsafe { (self.mem_alloc)(&mut ptr, bytes) };
        if rc == CUDA_ERROR_OUT_OF_MEMORY {
            return Ok(None);
        }
        self.check("cuMemAlloc_v2", rc)?;
        Ok(Some(ptr))
    }

    pub(crate) fn free(&self, ptr: CuDevicePtr) -> Result<(), ScrubError> {
        // SAFETY: `ptr` came from `alloc` and is freed once (the caller drains its list).
        self.check("cuMemFree_v2", unsafe { (self.mem_free)(ptr) })
    }

    pub(crate) fn memset(
        &self,
        ptr: CuDevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), ScrubError> {
        // SAFETY: `ptr..ptr+bytes` lies inside one allocation made by `alloc`.
        self.check("cuMemsetD8_v2", unsafe {
            (self.memset_d8)(ptr, value, bytes)
        })
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst` (synchronous).
    pub(crate) fn copy_to_host(&self, dst: &mut [u8], src: CuDevicePtr) -> Result<(), ScrubError> {
        // SAFETY: `dst` is valid for writes of its length; `src..src+len` lies inside one
        // device allocation (the caller bounds it by the chunk it belongs to).
        self.check("cuMemcpyDtoH_v2", unsafe {
            (self.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// Page-locked host memory, for full-speed read-back.
    pub(crate) fn alloc_host(&self, bytes: usize) -> Result<PinnedBuffer<'_>, ScrubError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer to `bytes` of page-locked memory.
        self.check("cuMemAllocHost_v2", unsafe {
            (self.mem_alloc_host)(&mut ptr, bytes)
        })?;
        Ok(PinnedBuffer {
            driver: self,
            ptr: ptr.cast(),
            len: bytes,
        })
    }
}

/// Page-locked host memory from `cuMemAllocHost`, freed on drop.
pub(crate) struct PinnedBuffer<'a> {
    driver: &'a CudaDriver,
    ptr: *mut u8,
    len: usize,
}

impl PinnedBuffer<'_> {
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points at `len` bytes owned by this buffer until drop; `&mut self`
        // guarantees no other reference exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAllocHost and is freed exactly once, here.
        unsafe { (self.driver.mem_free_host)(self.ptr.cast()) };
    }
}

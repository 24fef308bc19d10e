//! Kernels compiled at run time with NVRTC for the GPU they run on.

use std::ffi::{CString, c_void};
use std::fmt;

use cudarc::driver::sys;

use super::mem::Stream;
use super::{Context, CudaError, check, context};

/// One kernel of a module compiled with NVRTC for the GPU it runs on.
pub struct Kernel {
    module: sys::CUmodule,
    func: sys::CUfunction,
    ctx: &'static Context,
}

// SAFETY: module and function handles are usable from any thread with the context current.
unsafe impl Send for Kernel {}
// SAFETY: as above; never mutated.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Compile `src` with NVRTC for GPU `ordinal` and load kernel `name`.
    pub fn compile(ordinal: i32, src: &str, name: &str) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let (major, minor) = ctx.compute_capability()?;
        let fail = |call, name: String| CudaError {
            call,
            code: -1,
            name,
        };
        // SAFETY: only tries to dlopen the NVRTC library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(fail("nvrtc", "no NVRTC library (libnvrtc.so) found".into()));
        }
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![
                format!("--gpu-architecture=compute_{major}{minor}"),
                "-std=c++17".into(),
            ],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
            .map_err(|e| fail("nvrtcCompileProgram", format!("{e:?}")))?;
        let image = CString::new(ptx.to_src()).map_err(|e| fail("nvrtc", e.to_string()))?;
        let mut module = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX string; writes one module handle.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        let cname = CString::new(name).map_err(|e| fail("cuModuleGetFunction", e.to_string()))?;
        let mut func = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name; writes one handle.
        let got = check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut func, module, cname.as_ptr())
        });
        if let Err(e) = got {
            // SAFETY: unloads the module loaded above, once.
            let _ = unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(Self { module, func, ctx })
    }

    /// Launch on `stream` with `grid` x `block` threads.
    ///
    /// # Safety
    /// `params` must point at values of exactly the kernel's parameter
    /// types, and every address they carry must be valid for what the
    /// kernel does with it until the stream has passed the launch.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded caller contract; a live function and stream.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = self.ctx.make_current();
        // SAFETY: unloads the module loaded in `compile`, once.
        let _ = unsafe { sys::cuModuleUnload(self.module) };
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

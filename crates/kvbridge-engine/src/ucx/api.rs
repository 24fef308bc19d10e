//! A safe layer over the raw UCP bindings: context, worker, endpoint,
//! memory handle and remote key, each released by `Drop`, every call
//! returning `Result`.
//!
//! None of these types is `Send`: the UCX engine creates and uses all of them
//! on its one progress thread (the worker runs in `UCS_THREAD_MODE_SINGLE`),
//! so the compiler keeps every UCX call on that thread.

use std::ffi::{CStr, CString, c_int, c_void};
use std::fmt;
use std::rc::Rc;

use kvbridge_mem::MemoryKind;

use super::sys::{self, Ucp, ucp};

/// A failed UCX call (or UCX missing altogether).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UcxError {
    /// libucp could not be loaded; the text says why and what to install.
    #[error("{0}")]
    Unavailable(String),
    /// A UCP call returned an error status.
    #[error("{op}: {text} (ucs status {status})")]
    Call {
        /// The UCP function.
        op: &'static str,
        /// The `ucs_status_t` it returned.
        status: i32,
        /// UCX's description of the status.
        text: String,
    },
    /// A UCX setting that UCX refused (or that cannot be passed to it).
    #[error("bad UCX setting {key}={value}")]
    BadSetting {
        /// The setting's name (without the `UCX_` prefix).
        key: String,
        /// The value given.
        value: String,
        /// UCX's refusal, when it got that far.
        #[source]
        source: Option<Box<UcxError>>,
    },
    /// Something around UCX failed (threads, the side-channel port).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// The engine shut down before the request was carried out.
    #[error("engine shut down")]
    Shutdown,
    /// The thread that owns the UCX worker died while starting.
    #[error("the UCX progress thread died")]
    ProgressDied,
}

impl UcxError {
    /// An OS error met while `what`.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        UcxError::Io {
            what: what.into(),
            source: std::sync::Arc::new(source),
        }
    }
}

/// The description UCX gives a status code.
pub(crate) fn status_text(lib: &Ucp, status: i32) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated
    // string for any status value.
    let p = unsafe { (lib.status_string)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null static NUL-terminated string (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn check(lib: &Ucp, op: &'static str, status: i32) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Call {
            op,
            status,
            text: status_text(lib, status),
        })
    }
}

/// The loaded library, or why it is not there.
pub(crate) fn lib() -> Result<&'static Ucp, UcxError> {
    ucp().map_err(UcxError::Unavailable)
}

struct CtxInner {
    lib: &'static Ucp,
    h: sys::ucp_context_h,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_init and every worker and memory handle
        // of it holds an `Rc` to this, so it is cleaned up last, once.
        unsafe { (self.lib.cleanup)(self.h) };
    }
}

/// A UCP context with the RMA feature (and wake-up events).
#[derive(Clone)]
pub(crate) struct Context {
    inner: Rc<CtxInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ucx::Context")
    }
}

impl Context {
    /// Read UCX's configuration from its environment (`UCX_TLS`,
    /// `UCX_NET_DEVICES`, ...), apply `overrides` (`("TLS", "tcp")`, names
    /// without the `UCX_` prefix) and create the context.
    pub(crate) fn new(overrides: &[(String, String)]) -> Result<Self, UcxError> {
        let lib = lib()?;
        let mut cfg: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_" and no file; `cfg` is an out-parameter.
        check(lib, "ucp_config_read", unsafe {
            (lib.config_read)(std::ptr::null(), std::ptr::null(), &mut cfg)
        })?;
        let result = (|| {
            for (k, v) in overrides {
                let (ck, cv) = match (CString::new(k.as_str()), CString::new(v.as_str())) {
                    (Ok(a), Ok(b)) => (a, b),
                    _ => {
                        return Err(UcxError::BadSetting {
                            key: k.clone(),
                            value: v.clone(),
                            source: None,
                        });
                    }
                };
                // SAFETY: `cfg` is the live config read above; both strings are NUL-terminated.
                check(lib, "ucp_config_modify", unsafe {
                    (lib.config_modify)(cfg, ck.as_ptr(), cv.as_ptr())
                })
                .map_err(|e| UcxError::BadSetting {
                    key: k.clone(),
                    value: v.clone(),
                    source: Some(Box::new(e)),
                })?;
            }
            let params = sys::ucp_params_t {
                field_mask: sys::UCP_PARAM_FIELD_FEATURES
                    | sys::UCP_PARAM_FIELD_REQUEST_SIZE
                    | sys::UCP_PARAM_FIELD_NAME,
                features: sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP,
                request_size: REQUEST_AREA,
                request_init: std::ptr::null_mut(),
                request_cleanup: std::ptr::null_mut(),
                tag_sender_mask: 0,
                mt_workers_shared: 0,
                estimated_num_eps: 0,
                estimated_num_ppn: 0,
                name: c"kvbridge".as_ptr(),
            };
            let mut h: sys::ucp_context_h = std::ptr::null_mut();
            // SAFETY: params is fully initialised and outlives the call; `cfg` is live.
            check(lib, "ucp_init", unsafe {
                (lib.init_version)(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, cfg, &mut h)
            })?;
            Ok(Self {
                inner: Rc::new(CtxInner { lib, h }),
            })
        })();
        // SAFETY: `cfg` came from ucp_config_read and is released once; the
        // context copied what it needs during ucp_init.
        unsafe { (lib.config_release)(cfg) };
        result
    }

    /// Register `[addr, addr + len)` of `kind` with every transport (`ucp_mem_map`).
    ///
    /// # Safety
    /// The range must stay valid memory of `kind` until the handle is dropped.
    pub(crate) unsafe fn mem_map(
        &self,
        addr: u64,
        len: u64,
        kind: MemoryKind,
    ) -> Result<MemHandle, UcxError> {
        let lib = self.inner.lib;
        let memory_type = match kind {
            MemoryKind::Device { .. } => sys::UCS_MEMORY_TYPE_CUDA,
            MemoryKind::Managed => sys::UCS_MEMORY_TYPE_CUDA_MANAGED,
            _ => sys::UCS_MEMORY_TYPE_HOST,
        };
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: std::ptr::with_exposed_provenance_mut::<c_void>(addr as usize),
            length: len as usize,
            flags: 0,
            prot: 0,
            memory_type,
        };
        let mut h: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: live context; params describe memory the caller keeps valid.
        check(lib, "ucp_mem_map", unsafe {
            (lib.mem_map)(self.inner.h, &params, &mut h)
        })?;
        Ok(MemHandle {
            ctx: self.inner.clone(),
            h,
        })
    }
}

/// Bytes UCX reserves for us in every request (we keep a block index there).
pub(crate) const REQUEST_AREA: usize = 16;

/// Registered memory (`ucp_mem_map`); unmapped on drop.
pub(crate) struct MemHandle {
    ctx: Rc<CtxInner>,
    h: sys::ucp_mem_h,
}

impl fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ucx::MemHandle")
    }
}

impl MemHandle {
    /// The raw handle, for put parameters.
    pub(crate) fn raw(&self) -> sys::ucp_mem_h {
        self.h
    }

    /// The packed remote key peers unpack to write into this memory.
    pub(crate) fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let lib = self.ctx.lib;
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live context and memory handle; out-parameters.
        check(lib, "ucp_rkey_pack", unsafe {
            (lib.rkey_pack)(self.ctx.h, self.h, &mut buf, &mut len)
        })?;
        // SAFETY: on success UCX returns `len` readable bytes at `buf`,
        // copied here and released once right after.
        let out = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { (lib.rkey_buffer_release)(buf) };
        Ok(out)
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_mem_map on this (still live) context and
        // is unmapped once; the engine drops a handle only after every
        // operation reading the memory completed.
        let st = unsafe { (self.ctx.lib.mem_unmap)(self.ctx.h, self.h) };
        if st != sys::UCS_OK {
            tracing::warn!(
                status = %status_text(self.ctx.lib, st),
                "ucp_mem_unmap failed"
            );
        }
    }
}

/// A UCP worker in single-thread mode.
pub(crate) struct Worker {
    ctx: Context,
    h: sys::ucp_worker_h,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ucx::Worker")
    }
}

impl Worker {
    /// Create the worker of `ctx`.
    pub(crate) fn new(ctx: &Context) -> Result<Self, UcxError> {
        let lib = ctx.inner.lib;
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            cpu_mask: sys::ucs_cpu_set_t { bits: [0; 16] },
            events: 0,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut h: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: live context; params fully initialised; out-parameter.
        check(lib, "ucp_worker_create", unsafe {
            (lib.worker_create)(ctx.inner.h, &params, &mut h)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            h,
        })
    }

    fn lib(&self) -> &'static Ucp {
        self.ctx.inner.lib
    }

    /// The worker's address, which a peer needs to create an endpoint to it.
    pub(crate) fn address(&self) -> Result<Vec<u8>, UcxError> {
        let lib = self.lib();
        let mut a: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-parameters.
        check(lib, "ucp_worker_get_address", unsafe {
            (lib.worker_get_address)(self.h, &mut a, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `a`; copied, then released once.
        let out = unsafe { std::slice::from_raw_parts(a.cast::<u8>(), len) }.to_vec();
        // SAFETY: `a` came from ucp_worker_get_address of this worker.
        unsafe { (lib.worker_release_address)(self.h, a) };
        Ok(out)
    }

    /// Progress every transport once; returns how many events it handled.
    /// Callbacks of completed requests run inside this call.
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: live worker, used only from the thread that owns it.
        unsafe { (self.lib().worker_progress)(self.h) }
    }

    /// The file descriptor that becomes readable when the worker has events.
    pub(crate) fn event_fd(&self) -> Result<c_int, UcxError> {
        let mut fd: c_int = -1;
        // SAFETY: live worker; out-parameter.
        check(self.lib(), "ucp_worker_get_efd", unsafe {
            (self.lib().worker_get_efd)(self.h, &mut fd)
        })?;
        Ok(fd)
    }

    /// Arm the event fd; `Ok(false)` when events are already pending
    /// (progress again before sleeping).
    pub(crate) fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: live worker.
        let st = unsafe { (self.lib().worker_arm)(self.h) };
        match st {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            s => check(self.lib(), "ucp_worker_arm", s).map(|_| false),
        }
    }

    /// Connect to the worker at `address`. With `peer_errors`, UCX reports a
    /// failed peer through `on_error(arg, ep, status)` (inside `progress`)
    /// and completes its outstanding requests with errors; transports that
    /// cannot detect peer failure (UCX 1.13's shared memory) then refuse to
    /// connect, and the caller may retry without.
    ///
    /// # Safety
    /// `arg` must stay valid until the endpoint is closed and its close
    /// request completed.
    pub(crate) unsafe fn connect(
        &self,
        address: &[u8],
        peer_errors: bool,
        on_error: sys::ucp_err_handler_cb_t,
        arg: *mut c_void,
    ) -> Result<Endpoint, UcxError> {
        let params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: if peer_errors {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler_t { cb: on_error, arg },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: sys::ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: sys::ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        };
        let mut h: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: live worker; `address` is a peer worker address (UCX
        // validates its contents), alive for the call; out-parameter.
        check(self.lib(), "ucp_ep_create", unsafe {
            (self.lib().ep_create)(self.h, &params, &mut h)
        })?;
        Ok(Endpoint { lib: self.lib(), h })
    }

    /// Status of a pending request: `None` while in progress.
    pub(crate) fn request_status(&self, req: &Request) -> Option<i32> {
        // SAFETY: `req` is a live, not yet freed request of this worker.
        let st = unsafe { (self.lib().request_check_status)(req.0) };
        (st != sys::UCS_INPROGRESS).then_some(st)
    }

    /// `ucp_request_free`, for completion callbacks to free their request.
    pub(crate) fn request_free_fn(&self) -> unsafe extern "C" fn(*mut c_void) {
        self.lib().request_free
    }

    /// Free a request. Freeing a pending request also cancels its callback
    /// (UCX releases it silently when it completes).
    pub(crate) fn request_free(&self, req: Request) {
        // SAFETY: `req` is a live request of this worker, freed once (moved in).
        unsafe { (self.lib().request_free)(req.0) };
    }

    /// UCX's text for a status.
    pub(crate) fn status_text(&self, status: i32) -> String {
        status_text(self.lib(), status)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_worker_create; the engine closes every
        // endpoint of it first and drops it once, before its context.
        unsafe { (self.lib().worker_destroy)(self.h) };
    }
}

/// A pending UCP request.
#[derive(Debug)]
pub(crate) struct Request(*mut c_void);

impl Request {
    /// The user area UCX reserved in the request ([`REQUEST_AREA`] bytes).
    pub(crate) fn area(&self) -> *mut u64 {
        self.0.cast()
    }
}

/// What a non-blocking call returned.
#[derive(Debug)]
pub(crate) enum Op {
    /// Completed at once with this status (`UCS_OK` or an error).
    Done(i32),
    /// Running; its callback fires (inside `progress`) when it completes.
    Pending(Request),
}

fn op_of(p: sys::ucs_status_ptr_t) -> Op {
    if p.is_null() {
        Op::Done(sys::UCS_OK)
    } else if sys::ptr_is_err(p) {
        Op::Done(sys::ptr_status(p))
    } else {
        Op::Pending(Request(p))
    }
}

/// The send-completion callback and its argument for put / flush / close.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Callback {
    /// Called with `(request, status, user_data)`.
    pub cb: sys::ucp_send_nbx_callback_t,
    /// Passed as `user_data`.
    pub user_data: *mut c_void,
}

impl Callback {
    fn params(&self) -> sys::ucp_request_param_t {
        let mut p = sys::ucp_request_param_t::empty();
        if self.cb.is_some() {
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
            p.cb = self.cb;
            p.user_data = self.user_data;
        }
        p
    }
}

/// An endpoint to one peer worker. Must be closed with [`Endpoint::close`]
/// (dropping it without closing leaks it to the worker, which releases it).
pub(crate) struct Endpoint {
    lib: &'static Ucp,
    h: sys::ucp_ep_h,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ucx::Endpoint")
    }
}

impl Endpoint {
    /// Unpack a peer's packed remote key for use on this endpoint.
    pub(crate) fn unpack_rkey(&self, packed: &[u8]) -> Result<Rkey, UcxError> {
        let mut h: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: live endpoint; `packed` is readable for the call (UCX
        // parses it; a malformed key is reported as an error status).
        check(self.lib, "ucp_ep_rkey_unpack", unsafe {
            (self.lib.ep_rkey_unpack)(self.h, packed.as_ptr().cast(), &mut h)
        })?;
        Ok(Rkey { lib: self.lib, h })
    }

    /// One-sided write of `len` local bytes at `src` (in `memh`) to the
    /// peer's `dst` (covered by `rkey`).
    ///
    /// # Safety
    /// `[src, src + len)` must stay valid and unmodified until the put
    /// completes; `[dst, dst + len)` must lie inside the remote region of
    /// `rkey`; the callback argument must outlive the request.
    pub(crate) unsafe fn put(
        &self,
        src: u64,
        len: u64,
        dst: u64,
        rkey: &Rkey,
        memh: Option<&MemHandle>,
        cb: Callback,
    ) -> Op {
        let mut p = cb.params();
        if let Some(m) = memh {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            p.memh = m.raw();
        }
        let buf = std::ptr::with_exposed_provenance::<c_void>(src as usize);
        // SAFETY: per the caller contract; `p` outlives the call.
        op_of(unsafe { (self.lib.put_nbx)(self.h, buf, len as usize, dst, rkey.h, &p) })
    }

    /// Flush: completes once every operation issued before it is complete
    /// at the peer (the bytes are in its memory).
    ///
    /// # Safety
    /// The callback argument must outlive the request.
    pub(crate) unsafe fn flush(&self, cb: Callback) -> Op {
        let p = cb.params();
        // SAFETY: live endpoint; `p` outlives the call.
        op_of(unsafe { (self.lib.ep_flush_nbx)(self.h, &p) })
    }

    /// Close the endpoint: forcibly (outstanding operations fail at once) or
    /// after flushing. The returned request, if any, must be polled to completion.
    pub(crate) fn close(self, force: bool) -> Op {
        let mut p = sys::ucp_request_param_t::empty();
        if force {
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: live endpoint, closed once (`self` is consumed).
        op_of(unsafe { (self.lib.ep_close_nbx)(self.h, &p) })
    }
}

/// An unpacked remote key; destroyed on drop.
pub(crate) struct Rkey {
    lib: &'static Ucp,
    h: sys::ucp_rkey_h,
}

impl fmt::Debug for Rkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ucx::Rkey")
    }
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_ep_rkey_unpack and is destroyed once;
        // the engine drops keys only after the operations using them completed.
        unsafe { (self.lib.rkey_destroy)(self.h) };
    }
}

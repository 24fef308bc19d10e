//! Raw bindings to the subset of UCP (UCX 1.13 API) that the UCX engine
//! uses, resolved from `libucp.so.0` at run time with `dlopen`, so a binary
//! built with the `ucx` feature still starts on a machine without libucx
//! (the engine then reports "UCX is not available on this machine").
//!
//! The `#[repr(C)]` structs mirror `/usr/include/ucp/api/ucp.h` and
//! `ucp_def.h` of UCX 1.13 (Debian `libucx-dev` 1.13.1); their sizes and
//! field offsets were checked against the C headers (see the asserts at the
//! bottom). UCX keeps these parameter structs backward compatible (fields
//! are only appended and guarded by `field_mask`), so newer libraries accept
//! them.

#![allow(non_camel_case_types)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `ucs_status_t`.
pub(crate) type ucs_status_t = c_int;
/// `ucs_status_ptr_t`: NULL (ok), an error code, or a request pointer.
pub(crate) type ucs_status_ptr_t = *mut c_void;
/// Opaque handles.
pub(crate) type ucp_context_h = *mut c_void;
pub(crate) type ucp_config_t = c_void;
pub(crate) type ucp_worker_h = *mut c_void;
pub(crate) type ucp_ep_h = *mut c_void;
pub(crate) type ucp_mem_h = *mut c_void;
pub(crate) type ucp_rkey_h = *mut c_void;
pub(crate) type ucp_address_t = c_void;

pub(crate) const UCS_OK: ucs_status_t = 0;
pub(crate) const UCS_INPROGRESS: ucs_status_t = 1;
pub(crate) const UCS_ERR_INVALID_PARAM: ucs_status_t = -5;
pub(crate) const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
pub(crate) const UCS_ERR_INVALID_ADDR: ucs_status_t = -7;
pub(crate) const UCS_ERR_BUSY: ucs_status_t = -15;
pub(crate) const UCS_ERR_CANCELED: ucs_status_t = -16;
pub(crate) const UCS_ERR_TIMED_OUT: ucs_status_t = -20;
pub(crate) const UCS_ERR_REJECTED: ucs_status_t = -23;
pub(crate) const UCS_ERR_NOT_CONNECTED: ucs_status_t = -24;
pub(crate) const UCS_ERR_CONNECTION_RESET: ucs_status_t = -25;
pub(crate) const UCS_ERR_ENDPOINT_TIMEOUT: ucs_status_t = -80;
pub(crate) const UCS_ERR_LAST: ucs_status_t = -100;

pub(crate) const UCP_API_MAJOR: c_uint = 1;
pub(crate) const UCP_API_MINOR: c_uint = 13;

pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_REQUEST_SIZE: u64 = 1 << 1;
pub(crate) const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const UCS_THREAD_MODE_SINGLE: c_int = 0;

pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub(crate) const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub(crate) const UCS_MEMORY_TYPE_CUDA: c_int = 1;
pub(crate) const UCS_MEMORY_TYPE_CUDA_MANAGED: c_int = 2;

pub(crate) const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub(crate) const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;

/// `ucp_send_nbx_callback_t`.
pub(crate) type ucp_send_nbx_callback_t = Option<
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
>;
/// `ucp_err_handler_cb_t`.
pub(crate) type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;

/// `ucp_params_t`.
#[repr(C)]
pub(crate) struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucs_cpu_set_t` (1024 bits).
#[repr(C)]
pub(crate) struct ucs_cpu_set_t {
    pub bits: [u64; 16],
}

/// `ucp_worker_params_t`.
#[repr(C)]
pub(crate) struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: ucs_cpu_set_t,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub(crate) struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

/// `ucp_err_handler_t`.
#[repr(C)]
pub(crate) struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub(crate) struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub(crate) struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_request_param_t` (the callback union reduced to the send callback,
/// the receive-info union to a pointer: same size and alignment).
#[repr(C)]
pub(crate) struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_send_nbx_callback_t,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: ucp_mem_h,
}

impl ucp_request_param_t {
    /// All fields unset (`op_attr_mask` 0).
    pub(crate) fn empty() -> Self {
        Self {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: None,
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// The UCP entry points the engine calls, resolved from the loaded library.
#[allow(missing_docs)]
pub(crate) struct Ucp {
    pub get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t,
    pub config_modify:
        unsafe extern "C" fn(*mut ucp_config_t, *const c_char, *const c_char) -> ucs_status_t,
    pub config_release: unsafe extern "C" fn(*mut ucp_config_t),
    pub init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const ucp_params_t,
        *const ucp_config_t,
        *mut ucp_context_h,
    ) -> ucs_status_t,
    pub cleanup: unsafe extern "C" fn(ucp_context_h),
    pub worker_create: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_worker_params_t,
        *mut ucp_worker_h,
    ) -> ucs_status_t,
    pub worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub worker_get_address:
        unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t,
    pub worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address_t),
    pub worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub ep_create:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t,
    pub ep_close_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_flush_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub mem_map: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_mem_map_params_t,
        *mut ucp_mem_h,
    ) -> ucs_status_t,
    pub mem_unmap: unsafe extern "C" fn(ucp_context_h, ucp_mem_h) -> ucs_status_t,
    pub rkey_pack: unsafe extern "C" fn(
        ucp_context_h,
        ucp_mem_h,
        *mut *mut c_void,
        *mut usize,
    ) -> ucs_status_t,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack:
        unsafe extern "C" fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t,
    pub rkey_destroy: unsafe extern "C" fn(ucp_rkey_h),
    pub put_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        *const c_void,
        usize,
        u64,
        ucp_rkey_h,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(ucs_status_t) -> *const c_char,
    /// `major.minor.release` of the loaded library.
    pub version: (u32, u32, u32),
}

impl std::fmt::Debug for Ucp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Ucp {{ version: {}.{}.{} }}",
            self.version.0, self.version.1, self.version.2
        )
    }
}

/// Library names tried in order, unless `KVBRIDGE_UCX_LIB` names the one
/// to load (e.g. `/opt/hpcx/ucx/lib/libucp.so.0`).
const LIB_NAMES: &[&str] = &["libucp.so.0", "libucp.so"];

static LIB: OnceLock<Result<Ucp, String>> = OnceLock::new();

/// The process-wide UCP function table, loaded on first use; the error says
/// why UCX cannot be used here.
pub(crate) fn ucp() -> Result<&'static Ucp, String> {
    LIB.get_or_init(|| {
        let names: Vec<String> = match std::env::var("KVBRIDGE_UCX_LIB") {
            Ok(p) if !p.is_empty() => vec![p],
            _ => LIB_NAMES.iter().map(|s| (*s).to_owned()).collect(),
        };
        load_first(&names)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Load the first library of `names` that opens and resolve every symbol.
pub(crate) fn load_first(names: &[String]) -> Result<Ucp, String> {
    let mut why = Vec::new();
    for name in names {
        match open(name) {
            Ok(h) => return resolve(h).map_err(|e| format!("{name}: {e}")),
            Err(e) => why.push(e),
        }
    }
    Err(format!(
        "UCX is not available on this machine (install libucx0, or point \
         KVBRIDGE_UCX_LIB at libucp.so): {}",
        why.join("; ")
    ))
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local string
    // that stays valid until the next dl* call on this thread; copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dynamic loader error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn open(name: &str) -> Result<*mut c_void, String> {
    let c = std::ffi::CString::new(name).map_err(|_| format!("bad library name {name:?}"))?;
    // SAFETY: dlopen with a valid NUL-terminated name. Loading libucp runs
    // its constructors, which only initialise UCX's own globals. The handle
    // is never closed (UCX does not support being unloaded).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() { Err(dl_error()) } else { Ok(h) }
}

fn sym(h: *mut c_void, name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: `h` is a live handle from dlopen (never closed); `name` is
    // NUL-terminated. dlsym also searches libucp's dependencies (libucs).
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    if p.is_null() {
        Err(format!("missing symbol {}", name.to_string_lossy()))
    } else {
        Ok(p)
    }
}

macro_rules! resolve_fns {
    ($h:expr; $($field:ident = $name:literal),* $(,)?) => {{
        $(
            let $field = sym($h, $name)?;
        )*
        // SAFETY: each pointer was resolved from libucp by its exported C
        // name, and the field's declared signature matches that function's
        // prototype in the UCX 1.13 headers (ucp.h / status.h).
        unsafe {
            Ucp {
                $( $field: std::mem::transmute::<*mut c_void, _>($field), )*
                version: (0, 0, 0),
            }
        }
    }};
}

// Each transmute's target type is the table field it initialises.
#[allow(clippy::missing_transmute_annotations)]
fn resolve(h: *mut c_void) -> Result<Ucp, String> {
    let mut t = resolve_fns!(h;
        get_version = c"ucp_get_version",
        config_read = c"ucp_config_read",
        config_modify = c"ucp_config_modify",
        config_release = c"ucp_config_release",
        init_version = c"ucp_init_version",
        cleanup = c"ucp_cleanup",
        worker_create = c"ucp_worker_create",
        worker_destroy = c"ucp_worker_destroy",
        worker_get_address = c"ucp_worker_get_address",
        worker_release_address = c"ucp_worker_release_address",
        worker_progress = c"ucp_worker_progress",
        worker_get_efd = c"ucp_worker_get_efd",
        worker_arm = c"ucp_worker_arm",
        ep_create = c"ucp_ep_create",
        ep_close_nbx = c"ucp_ep_close_nbx",
        ep_flush_nbx = c"ucp_ep_flush_nbx",
        mem_map = c"ucp_mem_map",
        mem_unmap = c"ucp_mem_unmap",
        rkey_pack = c"ucp_rkey_pack",
        rkey_buffer_release = c"ucp_rkey_buffer_release",
        ep_rkey_unpack = c"ucp_ep_rkey_unpack",
        rkey_destroy = c"ucp_rkey_destroy",
        put_nbx = c"ucp_put_nbx",
        request_check_status = c"ucp_request_check_status",
        request_free = c"ucp_request_free",
        status_string = c"ucs_status_string",
    );
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: ucp_get_version only writes the three out-parameters.
    unsafe { (t.get_version)(&mut a, &mut b, &mut c) };
    if (a, b) < (UCP_API_MAJOR, UCP_API_MINOR) {
        return Err(format!(
            "libucp {a}.{b}.{c} is older than the UCX {UCP_API_MAJOR}.{UCP_API_MINOR} API kvbridge needs"
        ));
    }
    t.version = (a, b, c);
    Ok(t)
}

/// Whether a `ucs_status_ptr_t` is an error code.
pub(crate) fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// The status a non-pointer `ucs_status_ptr_t` carries.
pub(crate) fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

// Layouts checked against the UCX 1.13 headers (x86_64 / aarch64 LP64).
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ucp_params_t>() == 80);
    assert!(offset_of!(ucp_params_t, mt_workers_shared) == 48);
    assert!(offset_of!(ucp_params_t, name) == 72);
    assert!(size_of::<ucp_worker_params_t>() == 200);
    assert!(offset_of!(ucp_worker_params_t, events) == 144);
    assert!(offset_of!(ucp_worker_params_t, client_id) == 192);
    assert!(size_of::<ucp_ep_params_t>() == 104);
    assert!(offset_of!(ucp_ep_params_t, err_handler) == 24);
    assert!(offset_of!(ucp_ep_params_t, sockaddr) == 56);
    assert!(offset_of!(ucp_ep_params_t, local_sockaddr) == 88);
    assert!(size_of::<ucp_mem_map_params_t>() == 40);
    assert!(offset_of!(ucp_mem_map_params_t, memory_type) == 32);
    assert!(size_of::<ucp_request_param_t>() == 72);
    assert!(offset_of!(ucp_request_param_t, cb) == 16);
    assert!(offset_of!(ucp_request_param_t, memory_type) == 48);
    assert!(offset_of!(ucp_request_param_t, memh) == 64);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let e = load_first(&["libkvbridge-no-such-ucp.so.0".into()]).unwrap_err();
        assert!(e.starts_with("UCX is not available on this machine"), "{e}");
        assert!(e.contains("libkvbridge-no-such-ucp"), "{e}");
    }

    #[test]
    fn status_pointers_decode() {
        assert!(!ptr_is_err(std::ptr::null_mut()));
        let e = -25isize as usize as ucs_status_ptr_t;
        assert!(ptr_is_err(e));
        assert_eq!(ptr_status(e), -25);
        assert!(!ptr_is_err(0x1000 as ucs_status_ptr_t));
    }
}

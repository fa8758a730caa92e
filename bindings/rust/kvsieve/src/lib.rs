// SPDX-License-Identifier: Apache-2.0
//! Safe Rust API of kvsieve, sparse-attention decoding over a KV cache, on top of the raw C ABI
//! in `kvsieve-sys` (`include/kvsieve/kvsieve.h`).
//!
//! * [`Session`]: one sequence's KV cache and method index. Created from [`SessionParams`] (the
//!   fields of `kvs_session_params`, defaults from `kvs_session_params_init`) or loaded from a
//!   tables file; prefill, build the index, decode, append, save, fork. Dropping it frees it.
//! * [`Batch`]: sessions decoded together (plan once per token, decode per layer). It borrows its
//!   sessions mutably, so they outlive it and nothing else touches them while it exists
//!   ([`Batch::session_mut`] reaches one between tokens).
//! * Every fallible call returns [`Result<T>`]: the library's `kvs_error_t` becomes an [`Error`]
//!   with its [`Status`], message and backend code (the C error object is freed here).
//!
//! Tensors are CPU `f32` slices in C order: `q` is `[n, Hq, d]`, `k`/`v` `[n, Hkv, d]` for prefill
//! and append (n = tokens), `[Hq, d]` and `[Hkv, d]` for a decode step, `lse` `[Hq]`; batches put a
//! leading `[B]` in front. The leading dimension is taken from the slice length; a length that is
//! not a whole number of rows is refused here ([`Status::InvalidArgument`]), every other check
//! (token counts, layers, call order) is the library's own, with its message. The library only
//! reads inputs and writes outputs during the call: nothing is kept.
//!
//! Thread safety follows the header's tags: calls that change a session take `&mut self`
//! (`exclusive`), the others `&self` (`concurrent-const`), so `Session` is `Send + Sync`.
use kvsieve_sys as sys;
use std::ffi::{CStr, CString};
use std::fmt;
use std::os::raw::{c_char, c_void};
use std::path::Path;
use std::ptr::{self, NonNull};

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

/// `kvs_status`: what went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// A NULL, a wrong shape, dtype, device, layer or value.
    InvalidArgument,
    OutOfMemory,
    /// A valid request the build or method cannot do (e.g. no CUDA).
    Unsupported,
    /// A call out of order (decode before prefill, ...).
    InvalidState,
    /// open/read/write/rename failed.
    Io,
    FormatMagic,
    FormatVersion,
    FormatTruncated,
    FormatChecksum,
    FormatInvalid,
    /// CUDA / oneDNN / BLAS failure: see [`Error::backend_code`].
    Backend,
    AbiMismatch,
    Internal,
    /// A code this crate does not know (a newer library).
    Other(i32),
}

impl Status {
    /// The status of a `kvs_status` code.
    pub fn from_code(code: i32) -> Status {
        match code as sys::kvs_status {
            sys::KVS_STATUS_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::KVS_STATUS_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::KVS_STATUS_UNSUPPORTED => Status::Unsupported,
            sys::KVS_STATUS_INVALID_STATE => Status::InvalidState,
            sys::KVS_STATUS_IO => Status::Io,
            sys::KVS_STATUS_FORMAT_MAGIC => Status::FormatMagic,
            sys::KVS_STATUS_FORMAT_VERSION => Status::FormatVersion,
            sys::KVS_STATUS_FORMAT_TRUNCATED => Status::FormatTruncated,
            sys::KVS_STATUS_FORMAT_CHECKSUM => Status::FormatChecksum,
            sys::KVS_STATUS_FORMAT_INVALID => Status::FormatInvalid,
            sys::KVS_STATUS_BACKEND => Status::Backend,
            sys::KVS_STATUS_ABI_MISMATCH => Status::AbiMismatch,
            sys::KVS_STATUS_INTERNAL => Status::Internal,
            _ => Status::Other(code),
        }
    }

    /// The `kvs_status` code.
    pub fn code(self) -> i32 {
        (match self {
            Status::InvalidArgument => sys::KVS_STATUS_INVALID_ARGUMENT,
            Status::OutOfMemory => sys::KVS_STATUS_OUT_OF_MEMORY,
            Status::Unsupported => sys::KVS_STATUS_UNSUPPORTED,
            Status::InvalidState => sys::KVS_STATUS_INVALID_STATE,
            Status::Io => sys::KVS_STATUS_IO,
            Status::FormatMagic => sys::KVS_STATUS_FORMAT_MAGIC,
            Status::FormatVersion => sys::KVS_STATUS_FORMAT_VERSION,
            Status::FormatTruncated => sys::KVS_STATUS_FORMAT_TRUNCATED,
            Status::FormatChecksum => sys::KVS_STATUS_FORMAT_CHECKSUM,
            Status::FormatInvalid => sys::KVS_STATUS_FORMAT_INVALID,
            Status::Backend => sys::KVS_STATUS_BACKEND,
            Status::AbiMismatch => sys::KVS_STATUS_ABI_MISMATCH,
            Status::Internal => sys::KVS_STATUS_INTERNAL,
            Status::Other(c) => return c,
        }) as i32
    }
}

/// An error of the library (or of this crate's own argument checks, with status
/// [`Status::InvalidArgument`] and backend code 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
    backend_code: i64,
}

impl Error {
    pub fn status(&self) -> Status {
        self.status
    }
    /// The `kvs_status` code (`KVS_STATUS_*`).
    pub fn code(&self) -> i32 {
        self.status.code()
    }
    /// The library's message, naming the function, the argument and what was expected.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The backend's own code (cudaError_t, dnnl_status_t, errno), 0 if none.
    pub fn backend_code(&self) -> i64 {
        self.backend_code
    }

    fn invalid(message: String) -> Error {
        Error { status: Status::InvalidArgument, message, backend_code: 0 }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kvsieve: {} (status {:?} = {})", self.message, self.status, self.code())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Turns a `kvs_error_t` into a `Result`, freeing the error object.
fn check(e: sys::kvs_error_t) -> Result<()> {
    if e.is_null() {
        return Ok(());
    }
    // SAFETY: e is a live error object the call just handed over; it is destroyed once read.
    let err = unsafe {
        Error {
            status: Status::from_code(sys::kvs_error_code(e)),
            message: cstr(sys::kvs_error_message(e)).unwrap_or_default(),
            backend_code: sys::kvs_error_backend_code(e),
        }
    };
    unsafe { sys::kvs_error_destroy(e) };
    Err(err)
}

/// A copy of a static or borrowed C string (None for NULL).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        Some(CStr::from_ptr(p).to_string_lossy().into_owned())
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what}: contains a NUL byte: {s:?}")))
}

fn cpath(path: &Path) -> Result<CString> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::invalid(format!("path: contains a NUL byte: {}", path.display())))
    }
    #[cfg(not(unix))]
    {
        match path.to_str() {
            Some(s) => cstring("path", s),
            None => Err(Error::invalid(format!("path: not valid UTF-8: {}", path.display()))),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Library, methods
// ------------------------------------------------------------------------------------------------

/// "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version() -> String {
    unsafe { cstr(sys::kvs_version()) }.unwrap_or_default()
}

/// Fails with [`Status::AbiMismatch`] when the loaded library has another ABI than the header
/// these bindings were generated from. [`Session::new`] and [`Session::load`] call it.
pub fn abi_check() -> Result<()> {
    check(unsafe { sys::kvs_abi_check(sys::KVS_ABI_VERSION) })
}

/// `kvs_backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cpu,
    Cuda,
    Hybrid,
}

impl Backend {
    pub fn raw(self) -> i32 {
        (match self {
            Backend::Cpu => sys::KVS_BACKEND_CPU,
            Backend::Cuda => sys::KVS_BACKEND_CUDA,
            Backend::Hybrid => sys::KVS_BACKEND_HYBRID,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<Backend> {
        [Backend::Cpu, Backend::Cuda, Backend::Hybrid].into_iter().find(|b| b.raw() == v)
    }
}

/// `kvs_scalar_type`: the stored K/V type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarType {
    F32,
    F16,
    Bf16,
}

impl ScalarType {
    pub fn raw(self) -> i32 {
        (match self {
            ScalarType::F32 => sys::KVS_SCALAR_F32,
            ScalarType::F16 => sys::KVS_SCALAR_F16,
            ScalarType::Bf16 => sys::KVS_SCALAR_BF16,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<ScalarType> {
        [ScalarType::F32, ScalarType::F16, ScalarType::Bf16].into_iter().find(|t| t.raw() == v)
    }
}

/// `kvs_gemm_provider`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gemm {
    /// The KVS_GEMM environment variable ("onednn"/"openblas"), else oneDNN.
    Auto,
    OneDnn,
    OpenBlas,
}

impl Gemm {
    pub fn raw(self) -> i32 {
        (match self {
            Gemm::Auto => sys::KVS_GEMM_AUTO,
            Gemm::OneDnn => sys::KVS_GEMM_ONEDNN,
            Gemm::OpenBlas => sys::KVS_GEMM_OPENBLAS,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<Gemm> {
        [Gemm::Auto, Gemm::OneDnn, Gemm::OpenBlas].into_iter().find(|g| g.raw() == v)
    }
}

/// `kvs_lse_base`: the base of the log-sum-exp a decode step writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LseBase {
    /// Natural log (the default).
    E,
    /// log2 = ln / ln 2, for kernels that merge attention states in base 2 (FlashInfer's
    /// merge_state). The sessions of one cuda batch must share it.
    Two,
}

impl LseBase {
    pub fn raw(self) -> i32 {
        (match self {
            LseBase::E => sys::KVS_LSE_BASE_E,
            LseBase::Two => sys::KVS_LSE_BASE_2,
        }) as i32
    }
    fn from_raw(v: i32) -> Option<LseBase> {
        [LseBase::E, LseBase::Two].into_iter().find(|b| b.raw() == v)
    }
}

/// How a page of a caller's KV cache orders its tokens and heads (`kvs_kv_layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// `[num_kv_heads][page_size][head_dim]` per page (the default).
    Hnd,
    /// `[page_size][num_kv_heads][head_dim]` per page (vLLM's and FlashInfer's default; cuda backend).
    Nhd,
}

impl KvLayout {
    pub fn raw(self) -> i32 {
        (match self {
            KvLayout::Hnd => sys::KVS_KV_LAYOUT_HND,
            KvLayout::Nhd => sys::KVS_KV_LAYOUT_NHD,
        }) as i32
    }
}

/// One layer's KV cache as an inference engine keeps it (`kvs_paged_kv`, docs/api.md,
/// "kvs_session_bind_kv"): a pool of pages in the session's kv_dtype and the sequence's pages in
/// token order (token t is slot t % page_size of pool page page_indices[t / page_size]).
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// The pool (the K pool when `v_pages` is set): host memory (cpu backend) or GPU memory of the
    /// session's device (cuda backend).
    pub pages: *const std::ffi::c_void,
    pub num_pages: i64,
    /// Tokens per page: 256 on the cpu backend, a power of two in 16..1024 on the cuda backend.
    pub page_size: i32,
    /// The sequence's pages in token order (copied by the library).
    pub page_indices: &'a [i32],
    /// Tokens of the sequence the cache holds in this layer now.
    pub num_tokens: i64,
    /// Bytes the pool spans (0: not checked).
    pub pool_bytes: u64,
    pub layout: KvLayout,
    /// Null: K and V in one pool; else the V pool, of the K pool's shape (cuda backend).
    pub v_pages: *const std::ffi::c_void,
    pub v_pool_bytes: u64,
}

impl<'a> PagedKv<'a> {
    /// A pool in host memory (the cpu backend's form: HND pages of 256 tokens, K and V in one
    /// pool, `[num_pages][2][num_kv_heads][256][head_dim]`), its bytes known from the slice.
    pub fn host<T>(pool: &'a [T], num_pages: i64, page_size: i32, page_indices: &'a [i32], num_tokens: i64) -> Self {
        PagedKv {
            pages: pool.as_ptr() as *const std::ffi::c_void,
            num_pages,
            page_size,
            page_indices,
            num_tokens,
            pool_bytes: std::mem::size_of_val(pool) as u64,
            layout: KvLayout::Hnd,
            v_pages: ptr::null(),
            v_pool_bytes: 0,
        }
    }
}

/// The registered methods' names, in registry order.
pub fn methods() -> Vec<String> {
    let n = unsafe { sys::kvs_method_count() };
    (0..n).filter_map(|i| unsafe { cstr(sys::kvs_method_name(i)) }).collect()
}

/// One-line description of a method, None if unknown.
pub fn method_doc(method: &str) -> Option<String> {
    let m = CString::new(method).ok()?;
    unsafe { cstr(sys::kvs_method_doc(m.as_ptr())) }
}

/// Backends the method supports (empty if unknown).
pub fn method_backends(method: &str) -> Vec<Backend> {
    let mask = match CString::new(method) {
        Ok(m) => unsafe { sys::kvs_method_backends(m.as_ptr()) },
        Err(_) => 0,
    };
    [Backend::Cpu, Backend::Cuda, Backend::Hybrid].into_iter().filter(|b| mask & (1u32 << b.raw()) != 0).collect()
}

/// Why `method` cannot run on `backend` in this build; None when it can (or the method is
/// unknown: see [`method_doc`]).
pub fn method_unsupported_reason(method: &str, backend: Backend) -> Option<String> {
    let m = CString::new(method).ok()?;
    unsafe { cstr(sys::kvs_method_unsupported_reason(m.as_ptr(), backend.raw())) }
}

/// A method parameter (`kvs_param_info`): pass it as `name=value` in
/// [`SessionParams::method_params`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    pub name: String,
    /// "int", "float", "bool", "string", or "enum:a|b|c".
    pub type_: String,
    pub default_value: String,
    pub doc: String,
}

/// The parameters of a method; fails on an unknown method.
pub fn method_params(method: &str) -> Result<Vec<ParamInfo>> {
    let m = cstring("method", method)?;
    let mut n = 0usize;
    check(unsafe { sys::kvs_method_param_count(m.as_ptr(), &mut n) })?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: a plain C struct; struct_size set as the header asks, the rest filled by the call.
        let mut p: sys::kvs_param_info = unsafe { std::mem::zeroed() };
        p.struct_size = std::mem::size_of::<sys::kvs_param_info>() as u32;
        check(unsafe { sys::kvs_method_param(m.as_ptr(), i, &mut p) })?;
        out.push(unsafe {
            ParamInfo {
                name: cstr(p.name).unwrap_or_default(),
                type_: cstr(p.type_).unwrap_or_default(),
                default_value: cstr(p.default_value).unwrap_or_default(),
                doc: cstr(p.doc).unwrap_or_default(),
            }
        });
    }
    Ok(out)
}

/// Verifies a tables file (written by [`Session::save`]) and describes it as JSON (header,
/// parameters, sections with sizes and checksum status). A corrupt file gives the error.
pub fn tables_describe(path: impl AsRef<Path>) -> Result<String> {
    let p = cpath(path.as_ref())?;
    let mut json: *mut c_char = ptr::null_mut();
    let e = unsafe { sys::kvs_tables_describe(p.as_ptr(), &mut json) };
    // The one call that fills its output on error too: free both.
    let text = unsafe { cstr(json) };
    unsafe { sys::kvs_string_free(json) };
    check(e)?;
    Ok(text.unwrap_or_default())
}

// ------------------------------------------------------------------------------------------------
// Tensors
// ------------------------------------------------------------------------------------------------

/// A C-contiguous CPU f32 tensor description of a slice, with its shape stored alongside.
struct Tensor {
    shape: Vec<i64>,
    data: *mut f32,
}

impl Tensor {
    /// `[len / prod(inner), inner...]`; the slice must hold a whole number of rows.
    fn new(name: &str, data: *mut f32, len: usize, inner: &[u32], dims: &str) -> Result<Tensor> {
        let row: usize = inner.iter().map(|&x| x as usize).product();
        if row == 0 || len % row != 0 {
            return Err(Error::invalid(format!(
                "{name}: expected {dims} f32 values (a multiple of {row}), got a slice of {len}"
            )));
        }
        let mut shape = vec![(len / row) as i64];
        shape.extend(inner.iter().map(|&x| x as i64));
        Ok(Tensor { shape, data })
    }
    fn input(name: &str, s: &[f32], inner: &[u32], dims: &str) -> Result<Tensor> {
        // The library only reads inputs: the const-to-mut cast is the DLPack struct's, not a write.
        Tensor::new(name, s.as_ptr() as *mut f32, s.len(), inner, dims)
    }
    fn output(name: &str, s: &mut [f32], inner: &[u32], dims: &str) -> Result<Tensor> {
        Tensor::new(name, s.as_mut_ptr(), s.len(), inner, dims)
    }
    /// The kvs_tensor; valid while self (its shape) lives.
    fn raw(&mut self) -> sys::kvs_tensor {
        sys::kvs_tensor {
            data: self.data as *mut c_void,
            device: sys::kvs_device { device_type: sys::KVS_DEVICE_CPU as i32, device_id: 0 },
            ndim: self.shape.len() as i32,
            dtype: sys::kvs_dtype { code: sys::KVS_DTYPE_CODE_FLOAT as u8, bits: 32, lanes: 1 },
            shape: self.shape.as_mut_ptr(),
            strides: ptr::null_mut(),
            byte_offset: 0,
        }
    }
}

fn opt_ptr(t: &Option<sys::kvs_tensor>) -> *const sys::kvs_tensor {
    t.as_ref().map_or(ptr::null(), |t| t as *const _)
}

// ------------------------------------------------------------------------------------------------
// Sessions
// ------------------------------------------------------------------------------------------------

/// The shape of a session's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub num_layers: u32,
    pub num_q_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

/// `kvs_session_params`. [`SessionParams::new`] takes the defaults of `kvs_session_params_init`
/// (bf16 KV, cpu backend, method "full", ...); change fields or use the chained setters.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionParams {
    pub num_layers: u32,
    pub num_q_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// 0 = 1/sqrt(head_dim).
    pub softmax_scale: f32,
    pub kv_dtype: ScalarType,
    pub backend: Backend,
    /// The CUDA device for the cuda/hybrid backends.
    pub device_id: i32,
    /// CPU worker threads; 0 = all hardware threads.
    pub num_threads: u32,
    pub gemm: Gemm,
    /// Registry name; None = "full".
    pub method: Option<String>,
    /// "key=value,key=value" (see [`method_params`]); None = defaults.
    pub method_params: Option<String>,
    /// Fraction of the context in (0, 1]; 0 = unset.
    pub budget: f64,
    /// Absolute number of exact keys; 0 = unset. Wins over budget.
    pub budget_tokens: i64,
    /// The base of the lse that [`Session::decode`] writes.
    pub lse_base: LseBase,
    /// Tokens [`Session::truncate`] must be able to drop on methods whose index keeps history
    /// (csattention, ctkvr, lfps, hgca, retroinfer); 0 = none (full, exact_topk, streaming and
    /// quest need none). Costs up to two copies of the index and the queries of 2 * max_rollback
    /// tokens (docs/api.md, "Rollback").
    pub max_rollback: i64,
    /// Where the KV cache lives, a `kvs_device_type` (`sys::KVS_DEVICE_CUDA_HOST`: the cuda backend
    /// keeps it in pinned host memory that its kernels read over the bus); 0 = the backend's own.
    pub kv_memory: i32,
    /// Who stores the K/V: `KVS_KV_OWNED` (0, the default) or `KVS_KV_CALLER`, an engine's paged
    /// cache bound per layer with [`Session::bind_kv`] (set it with [`SessionParams::kv_from_caller`]).
    pub kv_source: i32,
}

impl SessionParams {
    pub fn new(num_layers: u32, num_q_heads: u32, num_kv_heads: u32, head_dim: u32) -> SessionParams {
        // SAFETY: a plain C struct, filled by its init function.
        let mut p: sys::kvs_session_params = unsafe { std::mem::zeroed() };
        unsafe { sys::kvs_session_params_init(&mut p) };
        SessionParams {
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            softmax_scale: p.softmax_scale,
            kv_dtype: ScalarType::from_raw(p.kv_dtype).unwrap_or(ScalarType::Bf16),
            backend: Backend::from_raw(p.backend).unwrap_or(Backend::Cpu),
            device_id: p.device_id,
            num_threads: p.num_threads,
            gemm: Gemm::from_raw(p.gemm).unwrap_or(Gemm::Auto),
            method: unsafe { cstr(p.method) },
            method_params: unsafe { cstr(p.method_params) },
            budget: p.budget,
            budget_tokens: p.budget_tokens,
            lse_base: LseBase::from_raw(p.lse_base).unwrap_or(LseBase::E),
            max_rollback: p.max_rollback,
            kv_memory: p.kv_memory,
            kv_source: p.kv_source,
        }
    }
    /// true: the session attends the caller's paged KV cache (`KVS_KV_CALLER`): bind each layer
    /// with [`Session::bind_kv`], then prefill, append and decode with the `_bound` calls.
    pub fn kv_from_caller(mut self, yes: bool) -> Self {
        self.kv_source = (if yes { sys::KVS_KV_CALLER } else { sys::KVS_KV_OWNED }) as i32;
        self
    }
    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.to_string());
        self
    }
    pub fn method_params(mut self, params: &str) -> Self {
        self.method_params = Some(params.to_string());
        self
    }
    pub fn kv_dtype(mut self, t: ScalarType) -> Self {
        self.kv_dtype = t;
        self
    }
    pub fn backend(mut self, b: Backend) -> Self {
        self.backend = b;
        self
    }
    pub fn budget(mut self, fraction: f64) -> Self {
        self.budget = fraction;
        self
    }
    pub fn budget_tokens(mut self, tokens: i64) -> Self {
        self.budget_tokens = tokens;
        self
    }
    pub fn num_threads(mut self, n: u32) -> Self {
        self.num_threads = n;
        self
    }
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = scale;
        self
    }
    pub fn lse_base(mut self, base: LseBase) -> Self {
        self.lse_base = base;
        self
    }
    pub fn max_rollback(mut self, tokens: i64) -> Self {
        self.max_rollback = tokens;
        self
    }
}

/// `kvs_load_params` (KV pages are always copied out of the file: the mapped mode of the C API,
/// whose file must then not change while the session lives, is not offered by this safe crate).
#[derive(Clone, Debug, PartialEq)]
pub struct LoadParams {
    /// None = as saved.
    pub backend: Option<Backend>,
    pub device_id: i32,
    /// 0 = all hardware threads.
    pub num_threads: u32,
    pub gemm: Gemm,
    /// As [`SessionParams::kv_memory`]; 0 = the backend's own memory.
    pub kv_memory: i32,
    /// As [`SessionParams::kv_source`]: `KVS_KV_CALLER` ([`LoadParams::kv_from_caller`]) loads the
    /// tables only, for a session over the caller's cache (bind each layer, then prefill it again
    /// with [`Session::prefill_bound`]).
    pub kv_source: i32,
}

impl Default for LoadParams {
    fn default() -> Self {
        let mut p: sys::kvs_load_params = unsafe { std::mem::zeroed() };
        unsafe { sys::kvs_load_params_init(&mut p) };
        LoadParams {
            backend: Backend::from_raw(p.backend),
            device_id: p.device_id,
            num_threads: p.num_threads,
            gemm: Gemm::from_raw(p.gemm).unwrap_or(Gemm::Auto),
            kv_memory: p.kv_memory,
            kv_source: p.kv_source,
        }
    }
}

impl LoadParams {
    /// true: load the tables only, for a session over the caller's cache (`KVS_KV_CALLER`).
    pub fn kv_from_caller(mut self, yes: bool) -> Self {
        self.kv_source = (if yes { sys::KVS_KV_CALLER } else { sys::KVS_KV_OWNED }) as i32;
        self
    }
}

/// `kvs_session_stats`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    pub tokens: i64,
    pub decode_steps: i64,
    pub kv_bytes: u64,
    pub kv_shared_bytes: u64,
    pub index_bytes: u64,
    pub workspace_bytes: u64,
    pub last_selected_keys: f64,
    pub mean_selected_keys: f64,
    pub last_selected_fraction: f64,
}

/// A session: one sequence's KV cache and method index (`kvs_session_t`), freed on drop.
pub struct Session {
    raw: NonNull<sys::kvs_session_s>,
    shape: Shape,
}

// SAFETY: the library serialises nothing itself but needs no thread affinity: `exclusive` calls
// take &mut self, `concurrent-const` ones &self.
unsafe impl Send for Session {}
unsafe impl Sync for Session {}

impl Drop for Session {
    fn drop(&mut self) {
        unsafe { sys::kvs_session_destroy(self.raw.as_ptr()) }
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").field("shape", &self.shape).finish()
    }
}

fn own(raw: sys::kvs_session_t, shape: Shape) -> Result<Session> {
    match NonNull::new(raw) {
        Some(raw) => Ok(Session { raw, shape }),
        None => {
            Err(Error { status: Status::Internal, message: "the library returned no session".into(), backend_code: 0 })
        }
    }
}

impl Session {
    /// `kvs_session_create`.
    pub fn new(params: &SessionParams) -> Result<Session> {
        abi_check()?;
        let method = params.method.as_deref().map(|m| cstring("method", m)).transpose()?;
        let mparams = params.method_params.as_deref().map(|m| cstring("method_params", m)).transpose()?;
        let mut p: sys::kvs_session_params = unsafe { std::mem::zeroed() };
        unsafe { sys::kvs_session_params_init(&mut p) };
        p.num_layers = params.num_layers;
        p.num_q_heads = params.num_q_heads;
        p.num_kv_heads = params.num_kv_heads;
        p.head_dim = params.head_dim;
        p.softmax_scale = params.softmax_scale;
        p.kv_dtype = params.kv_dtype.raw();
        p.backend = params.backend.raw();
        p.device_id = params.device_id;
        p.num_threads = params.num_threads;
        p.gemm = params.gemm.raw();
        p.method = method.as_ref().map_or(ptr::null(), |m| m.as_ptr());
        p.method_params = mparams.as_ref().map_or(ptr::null(), |m| m.as_ptr());
        p.budget = params.budget;
        p.budget_tokens = params.budget_tokens;
        p.lse_base = params.lse_base.raw();
        p.max_rollback = params.max_rollback;
        p.kv_memory = params.kv_memory;
        p.kv_source = params.kv_source;
        let mut raw: sys::kvs_session_t = ptr::null_mut();
        check(unsafe { sys::kvs_session_create(&p, &mut raw) })?;
        own(
            raw,
            Shape {
                num_layers: params.num_layers,
                num_q_heads: params.num_q_heads,
                num_kv_heads: params.num_kv_heads,
                head_dim: params.head_dim,
            },
        )
    }

    /// `kvs_session_load`: a session saved by [`Session::save`]. Every checksum and header value is
    /// verified; the KV pages and the index are copied. A file without KV gives a session whose
    /// layers must be prefilled again with the same lengths before decoding.
    pub fn load(path: impl AsRef<Path>, params: &LoadParams) -> Result<Session> {
        abi_check()?;
        let path = path.as_ref();
        let cp = cpath(path)?;
        let mut p: sys::kvs_load_params = unsafe { std::mem::zeroed() };
        unsafe { sys::kvs_load_params_init(&mut p) };
        p.backend = params.backend.map_or(0, |b| b.raw());
        p.device_id = params.device_id;
        p.num_threads = params.num_threads;
        p.gemm = params.gemm.raw();
        p.kv_memory = params.kv_memory;
        p.kv_source = params.kv_source;
        let mut raw: sys::kvs_session_t = ptr::null_mut();
        check(unsafe { sys::kvs_session_load(cp.as_ptr(), &p, &mut raw) })?;
        // The C ABI has no shape getter: the shape comes from the file's header, which the load
        // has just verified. Own the handle first, so that it is freed if describing fails.
        let mut s = own(raw, Shape { num_layers: 0, num_q_heads: 0, num_kv_heads: 0, head_dim: 0 })?;
        s.shape = shape_from_json(&tables_describe(path)?).ok_or_else(|| Error {
            status: Status::FormatInvalid,
            message: format!("{}: no \"shape\" in the tables header", path.display()),
            backend_code: 0,
        })?;
        Ok(s)
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    fn raw(&self) -> sys::kvs_session_t {
        self.raw.as_ptr()
    }

    /// `kvs_session_prefill`: a chunk of one layer's prompt, q `[n, Hq, d]`, k and v `[n, Hkv, d]`.
    /// `o` (`[n, Hq, d]`) receives causal attention of the chunk over the prompt so far.
    pub fn prefill(&mut self, layer: u32, q: &[f32], k: &[f32], v: &[f32], o: Option<&mut [f32]>) -> Result<()> {
        self.chunk(layer, q, Some((k, v)), o, false)
    }

    /// `kvs_session_build_index`: the method's index over every prefilled layer.
    pub fn build_index(&mut self) -> Result<()> {
        check(unsafe { sys::kvs_session_build_index(self.raw(), ptr::null_mut()) })
    }

    /// `kvs_session_decode`: one step of one layer. Appends k_new, v_new `[Hkv, d]`, attends with
    /// q `[Hq, d]` and writes o `[Hq, d]` and, when given, lse `[Hq]` (natural log).
    pub fn decode(
        &mut self,
        layer: u32,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        o: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        self.step(layer, q, Some((k_new, v_new)), o, lse)
    }

    /// `kvs_session_append`: several tokens of one layer after the index is built (a new chat
    /// turn), shapes as [`Session::prefill`]; `o` receives exact causal attention over the whole
    /// context.
    pub fn append(&mut self, layer: u32, q: &[f32], k: &[f32], v: &[f32], o: Option<&mut [f32]>) -> Result<()> {
        self.chunk(layer, q, Some((k, v)), o, true)
    }

    /// `kvs_session_truncate` (rollback): keeps the first `num_tokens` tokens of every layer and
    /// drops the rest, KV and index alike; decoding continues as if they had never been appended.
    /// The error names the allowed range (which depends on the method and `max_rollback`).
    pub fn truncate(&mut self, num_tokens: i64) -> Result<()> {
        check(unsafe { sys::kvs_session_truncate(self.raw(), num_tokens) })
    }

    /// `kvs_session_bind_kv` (sessions with `kv_from_caller(true)`): layer `layer`'s K/V are in
    /// the caller's paged cache `kv` now; kvsieve keeps no copy and reads them in place. Bind again
    /// whenever the engine's page table grows or changes; the `_bound` calls then count the next
    /// bound tokens as theirs. `stream`: a `cudaStream_t` (cuda backend), null for the default.
    ///
    /// # Safety
    /// The pool(s) `kv` points to must hold what `kv` describes and stay allocated until the layer
    /// is bound again or the session (and every fork of it) is dropped, and the K/V of the tokens
    /// the session counts must not change until [`Session::truncate`] drops them: the library reads
    /// them at every step without any borrow to enforce it.
    pub unsafe fn bind_kv(&mut self, layer: u32, kv: &PagedKv<'_>, stream: *mut std::ffi::c_void) -> Result<()> {
        let mut raw: sys::kvs_paged_kv = std::mem::zeroed();
        sys::kvs_paged_kv_init(&mut raw);
        raw.pages = kv.pages;
        raw.num_pages = kv.num_pages;
        raw.page_size = kv.page_size;
        raw.page_indices = kv.page_indices.as_ptr();
        raw.num_page_indices = kv.page_indices.len() as i64;
        raw.num_tokens = kv.num_tokens;
        raw.pool_bytes = kv.pool_bytes;
        raw.layout = kv.layout.raw();
        raw.v_pages = kv.v_pages;
        raw.v_pool_bytes = kv.v_pool_bytes;
        check(sys::kvs_session_bind_kv(self.raw(), layer, &raw, stream))
    }

    /// [`Session::prefill`] of a session over the caller's cache: q `[n, Hq, d]`, the chunk's K/V
    /// being the next n bound tokens.
    pub fn prefill_bound(&mut self, layer: u32, q: &[f32], o: Option<&mut [f32]>) -> Result<()> {
        self.chunk(layer, q, None, o, false)
    }

    /// [`Session::append`] of a session over the caller's cache (the next n bound tokens).
    pub fn append_bound(&mut self, layer: u32, q: &[f32], o: Option<&mut [f32]>) -> Result<()> {
        self.chunk(layer, q, None, o, true)
    }

    /// [`Session::decode`] of a session over the caller's cache: the step's token is the bound token
    /// at [`Session::layer_tokens`].
    pub fn decode_bound(&mut self, layer: u32, q: &[f32], o: &mut [f32], lse: Option<&mut [f32]>) -> Result<()> {
        self.step(layer, q, None, o, lse)
    }

    // A prefill (append false) or append chunk: q [n, Hq, d], k and v [n, Hkv, d], or none (the
    // caller's cache).
    fn chunk(
        &mut self,
        layer: u32,
        q: &[f32],
        kv: Option<(&[f32], &[f32])>,
        o: Option<&mut [f32]>,
        append: bool,
    ) -> Result<()> {
        let sh = self.shape;
        let (hq, hkv, d) = (sh.num_q_heads, sh.num_kv_heads, sh.head_dim);
        let mut tq = Tensor::input("q", q, &[hq, d], "[n, Hq, d]")?;
        let mut tkv = match kv {
            Some((k, v)) => Some((
                Tensor::input("k", k, &[hkv, d], "[n, Hkv, d]")?,
                Tensor::input("v", v, &[hkv, d], "[n, Hkv, d]")?,
            )),
            None => None,
        };
        let mut to = o.map(|o| Tensor::output("o", o, &[hq, d], "[n, Hq, d]")).transpose()?;
        let rq = tq.raw();
        let rk = tkv.as_mut().map(|(k, _)| k.raw());
        let rv = tkv.as_mut().map(|(_, v)| v.raw());
        let ro = to.as_mut().map(|t| t.raw());
        let f = if append { sys::kvs_session_append } else { sys::kvs_session_prefill };
        check(unsafe { f(self.raw(), layer, &rq, opt_ptr(&rk), opt_ptr(&rv), opt_ptr(&ro), ptr::null_mut()) })
    }

    // A decode step: q [Hq, d], k_new and v_new [Hkv, d] or none (the caller's cache), o [Hq, d].
    fn step(
        &mut self,
        layer: u32,
        q: &[f32],
        kv: Option<(&[f32], &[f32])>,
        o: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let d = self.shape.head_dim;
        let mut tq = Tensor::input("q", q, &[d], "[Hq, d]")?;
        let mut tkv = match kv {
            Some((k, v)) => {
                Some((Tensor::input("k_new", k, &[d], "[Hkv, d]")?, Tensor::input("v_new", v, &[d], "[Hkv, d]")?))
            }
            None => None,
        };
        let mut to = Tensor::output("o", o, &[d], "[Hq, d]")?;
        let mut tl = lse.map(|l| Tensor::output("lse", l, &[], "[Hq]")).transpose()?;
        let (rq, ro) = (tq.raw(), to.raw());
        let rk = tkv.as_mut().map(|(k, _)| k.raw());
        let rv = tkv.as_mut().map(|(_, v)| v.raw());
        let rl = tl.as_mut().map(|t| t.raw());
        check(unsafe {
            sys::kvs_session_decode(
                self.raw(),
                layer,
                &rq,
                opt_ptr(&rk),
                opt_ptr(&rv),
                &ro,
                opt_ptr(&rl),
                ptr::null_mut(),
            )
        })
    }

    /// `kvs_session_save`: parameters and method tables (and the KV cache when `include_kv`),
    /// written atomically.
    pub fn save(&self, path: impl AsRef<Path>, include_kv: bool) -> Result<()> {
        let p = cpath(path.as_ref())?;
        let flags = if include_kv { sys::KVS_SAVE_INCLUDE_KV } else { sys::KVS_SAVE_TABLES };
        check(unsafe { sys::kvs_session_save(self.raw(), p.as_ptr(), flags) })
    }

    /// `kvs_session_fork`: a new session sharing this one's KV prefix (copy-on-write).
    pub fn fork(&self) -> Result<Session> {
        let mut raw: sys::kvs_session_t = ptr::null_mut();
        check(unsafe { sys::kvs_session_fork(self.raw(), &mut raw) })?;
        own(raw, self.shape)
    }

    /// `kvs_session_get_stats`.
    pub fn stats(&self) -> Result<Stats> {
        let mut s: sys::kvs_session_stats = unsafe { std::mem::zeroed() };
        s.struct_size = std::mem::size_of::<sys::kvs_session_stats>() as u32;
        check(unsafe { sys::kvs_session_get_stats(self.raw(), &mut s) })?;
        Ok(Stats {
            tokens: s.tokens,
            decode_steps: s.decode_steps,
            kv_bytes: s.kv_bytes,
            kv_shared_bytes: s.kv_shared_bytes,
            index_bytes: s.index_bytes,
            workspace_bytes: s.workspace_bytes,
            last_selected_keys: s.last_selected_keys,
            mean_selected_keys: s.mean_selected_keys,
            last_selected_fraction: s.last_selected_fraction,
        })
    }

    /// `kvs_session_layer_tokens`: the number of tokens in a layer.
    pub fn layer_tokens(&self, layer: u32) -> Result<i64> {
        let mut n = 0i64;
        check(unsafe { sys::kvs_session_layer_tokens(self.raw(), layer, &mut n) })?;
        Ok(n)
    }

    /// `kvs_session_last_selection`: the keys the last decode step of `layer` attended for
    /// `kv_head`, ascending.
    pub fn last_selection(&self, layer: u32, kv_head: u32) -> Result<Vec<i32>> {
        let mut count = 0usize;
        check(unsafe { sys::kvs_session_last_selection(self.raw(), layer, kv_head, ptr::null_mut(), 0, &mut count) })?;
        let mut out = vec![0i32; count];
        let mut count2 = 0usize;
        check(unsafe {
            sys::kvs_session_last_selection(self.raw(), layer, kv_head, out.as_mut_ptr(), out.len(), &mut count2)
        })?;
        out.truncate(count2.min(count));
        Ok(out)
    }

    /// `kvs_session_method_stat`: a statistic by name.
    pub fn method_stat(&self, name: &str) -> Result<f64> {
        let n = cstring("name", name)?;
        let mut v = 0f64;
        check(unsafe { sys::kvs_session_method_stat(self.raw(), n.as_ptr(), &mut v) })?;
        Ok(v)
    }
}

/// The unsigned integer after `"key":` inside the object that follows `"object":`.
fn json_uint(json: &str, object: &str, key: &str) -> Option<u32> {
    let start = json.find(&format!("\"{object}\""))?;
    let rest = &json[start..];
    let open = rest.find('{')?;
    let close = open + rest[open..].find('}')?;
    let body = &rest[open..close];
    let at = body.find(&format!("\"{key}\""))? + key.len() + 2;
    let after = body[at..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

fn shape_from_json(json: &str) -> Option<Shape> {
    let header = &json[json.find("\"header\"")?..];
    Some(Shape {
        num_layers: json_uint(header, "shape", "num_layers")?,
        num_q_heads: json_uint(header, "shape", "num_q_heads")?,
        num_kv_heads: json_uint(header, "shape", "num_kv_heads")?,
        head_dim: json_uint(header, "shape", "head_dim")?,
    })
}

// ------------------------------------------------------------------------------------------------
// Batches
// ------------------------------------------------------------------------------------------------

/// Step tensors `[B, H, d]` of a batch: checked and described.
fn batch_tensors(
    shape: Shape,
    q: &[f32],
    k_new: &[f32],
    v_new: &[f32],
    o: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<[Option<Tensor>; 5]> {
    let (hq, hkv, d) = (shape.num_q_heads, shape.num_kv_heads, shape.head_dim);
    Ok([
        Some(Tensor::input("q", q, &[hq, d], "[B, Hq, d]")?),
        Some(Tensor::input("k_new", k_new, &[hkv, d], "[B, Hkv, d]")?),
        Some(Tensor::input("v_new", v_new, &[hkv, d], "[B, Hkv, d]")?),
        Some(Tensor::output("o", o, &[hq, d], "[B, Hq, d]")?),
        lse.map(|l| Tensor::output("lse", l, &[hq], "[B, Hq]")).transpose()?,
    ])
}

/// `kvs_decode_batch`: one layer's decode step for several sessions of the same shape, method and
/// backend at once (q `[B, Hq, d]`, k_new, v_new `[B, Hkv, d]`, o `[B, Hq, d]`, lse `[B, Hq]`).
/// All or nothing. For many tokens, a [`Batch`] plans once per token instead.
pub fn decode_batch(
    sessions: &mut [&mut Session],
    layer: u32,
    q: &[f32],
    k_new: &[f32],
    v_new: &[f32],
    o: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let first =
        sessions.first().ok_or_else(|| Error::invalid("decode_batch: sessions: expected 1 or more, got 0".into()))?;
    let mut ts = batch_tensors(first.shape, q, k_new, v_new, o, lse)?;
    let raw: Vec<Option<sys::kvs_tensor>> = ts.iter_mut().map(|t| t.as_mut().map(|t| t.raw())).collect();
    let mut handles: Vec<sys::kvs_session_t> = sessions.iter().map(|s| s.raw()).collect();
    check(unsafe {
        sys::kvs_decode_batch(
            handles.as_mut_ptr(),
            handles.len(),
            layer,
            opt_ptr(&raw[0]),
            opt_ptr(&raw[1]),
            opt_ptr(&raw[2]),
            opt_ptr(&raw[3]),
            opt_ptr(&raw[4]),
            ptr::null_mut(),
        )
    })
}

/// A batch of sessions decoded together, in a fixed order (the B dimension of the step tensors):
/// [`Batch::plan`] once per token, then [`Batch::decode`] once per layer. It holds its sessions'
/// mutable borrows; [`Batch::session_mut`] uses one on its own between tokens,
/// [`Batch::into_sessions`] gives them back. Dropping it frees the batch, not the sessions.
pub struct Batch<'a> {
    raw: NonNull<sys::kvs_batch_s>,
    sessions: Vec<&'a mut Session>,
}

impl fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch").field("sessions", &self.sessions.len()).finish()
    }
}

unsafe impl Send for Batch<'_> {}
unsafe impl Sync for Batch<'_> {}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        // Runs before the borrows of the sessions end: the batch never outlives them.
        unsafe { sys::kvs_batch_destroy(self.raw.as_ptr()) }
    }
}

impl<'a> Batch<'a> {
    /// `kvs_batch_create`: 1..65536 sessions of the same shape, KV dtype, softmax scale, method,
    /// backend and device.
    pub fn new<I: IntoIterator<Item = &'a mut Session>>(sessions: I) -> Result<Batch<'a>> {
        let sessions: Vec<&'a mut Session> = sessions.into_iter().collect();
        let mut handles: Vec<sys::kvs_session_t> = sessions.iter().map(|s| s.raw()).collect();
        let mut raw: sys::kvs_batch_t = ptr::null_mut();
        // An empty list reaches the library as a dangling (non-NULL) array of count 0: its error.
        check(unsafe { sys::kvs_batch_create(handles.as_mut_ptr(), handles.len(), &mut raw) })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Batch { raw, sessions }),
            None => Err(Error {
                status: Status::Internal,
                message: "the library returned no batch".into(),
                backend_code: 0,
            }),
        }
    }

    /// `kvs_batch_size`.
    pub fn len(&self) -> usize {
        unsafe { sys::kvs_batch_size(self.raw.as_ptr()) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn session(&self, i: usize) -> &Session {
        self.sessions[i]
    }

    /// Session `i`, to be used on its own between tokens.
    pub fn session_mut(&mut self, i: usize) -> &mut Session {
        self.sessions[i]
    }

    /// Frees the batch and gives the sessions back.
    pub fn into_sessions(mut self) -> Vec<&'a mut Session> {
        std::mem::take(&mut self.sessions)
    }

    /// `kvs_batch_plan`: once per token, before that token's decode calls: checks every session
    /// and layer and reserves room for one more token.
    pub fn plan(&mut self) -> Result<()> {
        check(unsafe { sys::kvs_batch_plan(self.raw.as_ptr(), ptr::null_mut()) })
    }

    /// `kvs_batch_decode`: one layer's step for the planned token, each layer at most once per
    /// plan. q `[B, Hq, d]`, k_new, v_new `[B, Hkv, d]`, o `[B, Hq, d]`, lse `[B, Hq]`.
    pub fn decode(
        &mut self,
        layer: u32,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        o: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let mut ts = batch_tensors(self.sessions[0].shape, q, k_new, v_new, o, lse)?;
        let raw: Vec<Option<sys::kvs_tensor>> = ts.iter_mut().map(|t| t.as_mut().map(|t| t.raw())).collect();
        check(unsafe {
            sys::kvs_batch_decode(
                self.raw.as_ptr(),
                layer,
                opt_ptr(&raw[0]),
                opt_ptr(&raw[1]),
                opt_ptr(&raw[2]),
                opt_ptr(&raw[3]),
                opt_ptr(&raw[4]),
                ptr::null_mut(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_from_describe_json() {
        let j = r#"{"path":"x","header":{"method":{"name":"full"},"shape":{"head_dim":16, "num_kv_heads" : 2,"num_layers":3,"num_q_heads":4}},"ok":true}"#;
        assert_eq!(shape_from_json(j), Some(Shape { num_layers: 3, num_q_heads: 4, num_kv_heads: 2, head_dim: 16 }));
        assert_eq!(shape_from_json(r#"{"header":null}"#), None);
    }

    #[test]
    fn status_codes_round_trip() {
        for c in 1..=13 {
            assert_eq!(Status::from_code(c).code(), c);
            assert!(!matches!(Status::from_code(c), Status::Other(_)));
        }
        assert_eq!(Status::from_code(99), Status::Other(99));
    }
}

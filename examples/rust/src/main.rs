// SPDX-License-Identifier: Apache-2.0
//! kvsieve from Rust: hand-written declarations of the part of the C ABI this program uses
//! (include/kvsieve/kvsieve.h), a prefill and a decode checked against a reference, a batch of two
//! sessions (plan per token, decode per layer) checked against per-session decodes, and an error.
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_void};
use std::ptr;

#[repr(C)]
struct Device { device_type: i32, device_id: i32 }
#[repr(C)]
struct DType { code: u8, bits: u8, lanes: u16 }
#[repr(C)]
struct Tensor {
    data: *mut c_void,
    device: Device,
    ndim: i32,
    dtype: DType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}
#[repr(C)]
struct SessionParams {
    struct_size: u32,
    num_layers: u32,
    num_q_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    softmax_scale: f32,
    kv_dtype: i32,
    backend: i32,
    device_id: i32,
    num_threads: u32,
    gemm: i32,
    method: *const c_char,
    method_params: *const c_char,
    budget: f64,
    budget_tokens: i64,
}
enum ErrorS {}
enum SessionS {}
enum BatchS {}
type Error = *mut ErrorS;
type Session = *mut SessionS;
type Batch = *mut BatchS;

const KVS_ABI_VERSION: u32 = 0;
const KVS_STATUS_INVALID_ARGUMENT: i32 = 1;
const KVS_STATUS_INVALID_STATE: i32 = 4;
const KVS_BACKEND_CPU: i32 = 1;
const KVS_BACKEND_HYBRID: i32 = 3;
const KVS_SCALAR_F32: i32 = 1;

#[link(name = "kvsieve")]
extern "C" {
    fn kvs_version() -> *const c_char;
    fn kvs_abi_check(v: u32) -> Error;
    fn kvs_error_code(e: *const ErrorS) -> i32;
    fn kvs_error_message(e: *const ErrorS) -> *const c_char;
    fn kvs_error_destroy(e: Error);
    fn kvs_session_params_init(p: *mut SessionParams);
    fn kvs_session_create(p: *const SessionParams, out: *mut Session) -> Error;
    fn kvs_session_destroy(s: Session);
    fn kvs_session_prefill(s: Session, layer: u32, q: *const Tensor, k: *const Tensor, v: *const Tensor,
                           o: *const Tensor, stream: *mut c_void) -> Error;
    fn kvs_session_build_index(s: Session, stream: *mut c_void) -> Error;
    fn kvs_session_decode(s: Session, layer: u32, q: *const Tensor, k: *const Tensor, v: *const Tensor,
                          o: *const Tensor, lse: *const Tensor, stream: *mut c_void) -> Error;
    fn kvs_session_fork(s: Session, out: *mut Session) -> Error;
    fn kvs_method_unsupported_reason(method: *const c_char, backend: i32) -> *const c_char;
    fn kvs_batch_create(sessions: *mut Session, count: usize, out: *mut Batch) -> Error;
    fn kvs_batch_destroy(b: Batch);
    fn kvs_batch_plan(b: Batch, stream: *mut c_void) -> Error;
    fn kvs_batch_decode(b: Batch, layer: u32, q: *const Tensor, k: *const Tensor, v: *const Tensor,
                        o: *const Tensor, lse: *const Tensor, stream: *mut c_void) -> Error;
    fn kvs_batch_size(b: Batch) -> usize;
}

/// A kvs_error_t turned into a Rust Result (the error object is freed here).
fn check(e: Error) -> Result<(), (i32, String)> {
    if e.is_null() {
        return Ok(());
    }
    let r = unsafe { (kvs_error_code(e), CStr::from_ptr(kvs_error_message(e)).to_string_lossy().into_owned()) };
    unsafe { kvs_error_destroy(e) };
    Err(r)
}

fn tensor(data: &mut [f32], shape: &mut [i64]) -> Tensor {
    Tensor {
        data: data.as_mut_ptr() as *mut c_void,
        device: Device { device_type: 1, device_id: 0 },
        ndim: shape.len() as i32,
        dtype: DType { code: 2, bits: 32, lanes: 1 },
        shape: shape.as_mut_ptr(),
        strides: ptr::null_mut(),
        byte_offset: 0,
    }
}

struct OwnedSession(Session);
impl Drop for OwnedSession {
    fn drop(&mut self) { unsafe { kvs_session_destroy(self.0) } }
}

/// Owns the batch, not its sessions: declared after them, so it is dropped first.
struct OwnedBatch(Batch);
impl Drop for OwnedBatch {
    fn drop(&mut self) { unsafe { kvs_batch_destroy(self.0) } }
}

/// A batch of two 2-layer quest sessions with different prompts decodes three tokens (plan once per
/// token, decode per layer); forks taken before the batch steps decode the same tokens one session
/// at a time. Returns the largest difference between the two.
fn batch_example(rnd: &mut dyn FnMut(usize) -> Vec<f32>) -> f64 {
    const L: u32 = 2;
    const B: usize = 2;
    const HQ: usize = 4;
    const HKV: usize = 2;
    const D: usize = 16;
    const N: usize = 48;
    let method = CString::new("quest").unwrap();
    let reason = unsafe { kvs_method_unsupported_reason(method.as_ptr(), KVS_BACKEND_CPU) };
    assert!(reason.is_null(), "quest runs on the CPU");
    let hybrid = unsafe { kvs_method_unsupported_reason(method.as_ptr(), KVS_BACKEND_HYBRID) };
    if !hybrid.is_null() {
        println!("rust: quest on hybrid: {}", unsafe { CStr::from_ptr(hybrid) }.to_string_lossy());
    }
    let mut p: SessionParams = unsafe { std::mem::zeroed() };
    unsafe { kvs_session_params_init(&mut p) };
    p.num_layers = L;
    p.num_q_heads = HQ as u32;
    p.num_kv_heads = HKV as u32;
    p.head_dim = D as u32;
    p.kv_dtype = KVS_SCALAR_F32;
    p.method = method.as_ptr();
    p.budget = 0.25;
    let mut sessions = Vec::new();
    let mut forks = Vec::new();
    for _ in 0..B {
        let mut raw: Session = ptr::null_mut();
        check(unsafe { kvs_session_create(&p, &mut raw) }).expect("create");
        let s = OwnedSession(raw);
        let (mut q, mut k, mut v) = (rnd(N * HQ * D), rnd(N * HKV * D), rnd(N * HKV * D));
        let (mut sq, mut skv) = ([N as i64, HQ as i64, D as i64], [N as i64, HKV as i64, D as i64]);
        let (tq, tk, tv) = (tensor(&mut q, &mut sq), tensor(&mut k, &mut skv.clone()), tensor(&mut v, &mut skv));
        for layer in 0..L {
            check(unsafe { kvs_session_prefill(s.0, layer, &tq, &tk, &tv, ptr::null(), ptr::null_mut()) }).expect("prefill");
        }
        check(unsafe { kvs_session_build_index(s.0, ptr::null_mut()) }).expect("build_index");
        let mut f: Session = ptr::null_mut();
        check(unsafe { kvs_session_fork(s.0, &mut f) }).expect("fork");
        sessions.push(s);
        forks.push(OwnedSession(f));
    }
    let mut handles: Vec<Session> = sessions.iter().map(|s| s.0).collect();
    let mut raw: Batch = ptr::null_mut();
    check(unsafe { kvs_batch_create(handles.as_mut_ptr(), handles.len(), &mut raw) }).expect("batch_create");
    let batch = OwnedBatch(raw);
    assert_eq!(unsafe { kvs_batch_size(batch.0) }, B);
    let mut worst = 0f64;
    for _token in 0..3 {
        check(unsafe { kvs_batch_plan(batch.0, ptr::null_mut()) }).expect("batch_plan");
        for layer in 0..L {
            let (mut q, mut k, mut v) = (rnd(B * HQ * D), rnd(B * HKV * D), rnd(B * HKV * D));
            let (mut o, mut lse) = (vec![0f32; B * HQ * D], vec![0f32; B * HQ]);
            let (mut s3q, mut s3kv, mut s2l) = ([B as i64, HQ as i64, D as i64], [B as i64, HKV as i64, D as i64], [B as i64, HQ as i64]);
            let (tq, tk, tv) = (tensor(&mut q, &mut s3q.clone()), tensor(&mut k, &mut s3kv.clone()), tensor(&mut v, &mut s3kv));
            let (to, tl) = (tensor(&mut o, &mut s3q), tensor(&mut lse, &mut s2l));
            check(unsafe { kvs_batch_decode(batch.0, layer, &tq, &tk, &tv, &to, &tl, ptr::null_mut()) }).expect("batch_decode");
            if layer == 0 {
                // each layer at most once per plan
                match check(unsafe { kvs_batch_decode(batch.0, 0, &tq, &tk, &tv, &to, &tl, ptr::null_mut()) }) {
                    Err((code, _)) if code == KVS_STATUS_INVALID_STATE => {}
                    other => panic!("expected INVALID_STATE for a layer decoded twice, got {other:?}"),
                }
            }
            for b in 0..B {
                let (mut qb, mut kb, mut vb) = (q[b * HQ * D..(b + 1) * HQ * D].to_vec(), k[b * HKV * D..(b + 1) * HKV * D].to_vec(),
                                                v[b * HKV * D..(b + 1) * HKV * D].to_vec());
                let (mut ob, mut lb) = (vec![0f32; HQ * D], vec![0f32; HQ]);
                let (mut s2q, mut s2kv, mut s1) = ([HQ as i64, D as i64], [HKV as i64, D as i64], [HQ as i64]);
                let (t1, tk1, tv1) = (tensor(&mut qb, &mut s2q.clone()), tensor(&mut kb, &mut s2kv.clone()), tensor(&mut vb, &mut s2kv));
                let (to1, tl1) = (tensor(&mut ob, &mut s2q), tensor(&mut lb, &mut s1));
                check(unsafe { kvs_session_decode(forks[b].0, layer, &t1, &tk1, &tv1, &to1, &tl1, ptr::null_mut()) }).expect("decode");
                for i in 0..HQ * D {
                    worst = worst.max((ob[i] - o[b * HQ * D + i]).abs() as f64);
                }
                for h in 0..HQ {
                    worst = worst.max((lb[h] - lse[b * HQ + h]).abs() as f64);
                }
            }
        }
    }
    drop(batch); // before the sessions it points to
    worst
}

fn main() {
    const HQ: usize = 4;
    const HKV: usize = 2;
    const D: usize = 16;
    const N: usize = 64;
    check(unsafe { kvs_abi_check(KVS_ABI_VERSION) }).expect("ABI");
    let mut seed = 12345u32;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n).map(|_| { seed = seed.wrapping_mul(1103515245).wrapping_add(12345); ((seed >> 8) & 0xffff) as f32 / 32768.0 - 1.0 }).collect()
    };
    let (mut q, k, v) = (rnd(N * HQ * D), rnd((N + 1) * HKV * D), rnd((N + 1) * HKV * D));
    let (mut q1, mut o, mut lse) = (rnd(HQ * D), vec![0f32; HQ * D], vec![0f32; HQ]);

    let method = CString::new("full").unwrap();
    let mut p: SessionParams = unsafe { std::mem::zeroed() };
    unsafe { kvs_session_params_init(&mut p) };
    p.num_layers = 1;
    p.num_q_heads = HQ as u32;
    p.num_kv_heads = HKV as u32;
    p.head_dim = D as u32;
    p.kv_dtype = KVS_SCALAR_F32;
    p.method = method.as_ptr();
    let mut raw: Session = ptr::null_mut();
    check(unsafe { kvs_session_create(&p, &mut raw) }).expect("create");
    let s = OwnedSession(raw);

    let (mut sq, mut skv) = ([N as i64, HQ as i64, D as i64], [N as i64, HKV as i64, D as i64]);
    let (kp, vp) = (&mut k[..N * HKV * D].to_vec(), &mut v[..N * HKV * D].to_vec());
    let (tq, tk, tv) = (tensor(&mut q, &mut sq), tensor(kp, &mut skv.clone()), tensor(vp, &mut skv));
    check(unsafe { kvs_session_prefill(s.0, 0, &tq, &tk, &tv, ptr::null(), ptr::null_mut()) }).expect("prefill");
    check(unsafe { kvs_session_build_index(s.0, ptr::null_mut()) }).expect("build_index");
    let (mut s2q, mut s2kv, mut s1) = ([HQ as i64, D as i64], [HKV as i64, D as i64], [HQ as i64]);
    let mut kn = k[N * HKV * D..].to_vec();
    let mut vn = v[N * HKV * D..].to_vec();
    let (t1, tkn, tvn) = (tensor(&mut q1, &mut s2q.clone()), tensor(&mut kn, &mut s2kv.clone()), tensor(&mut vn, &mut s2kv));
    let (to, tl) = (tensor(&mut o, &mut s2q), tensor(&mut lse, &mut s1));
    check(unsafe { kvs_session_decode(s.0, 0, &t1, &tkn, &tvn, &to, &tl, ptr::null_mut()) }).expect("decode");

    // dense attention in f64 over the N + 1 keys
    let scale = 1.0 / (D as f64).sqrt();
    let mut worst = 0f64;
    for h in 0..HQ {
        let kh = h / (HQ / HKV);
        let sc: Vec<f64> = (0..=N).map(|j| scale * (0..D).map(|c| q1[h * D + c] as f64 * k[(j * HKV + kh) * D + c] as f64).sum::<f64>()).collect();
        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        worst = worst.max((m + sum.ln() - lse[h] as f64).abs());
        for c in 0..D {
            let acc: f64 = (0..=N).map(|j| (sc[j] - m).exp() * v[(j * HKV + kh) * D + c] as f64).sum();
            worst = worst.max((acc / sum - o[h * D + c] as f64).abs());
        }
    }
    let version = unsafe { CStr::from_ptr(kvs_version()) }.to_string_lossy();
    println!("rust: kvsieve {version}: decode max |error| vs f64 reference = {worst:.2e}");
    assert!(worst < 1e-4, "decode does not match the reference");

    let batch_worst = batch_example(&mut rnd);
    println!("rust: batch of 2 sessions, 3 tokens x 2 layers: max |batch - per-session decode| = {batch_worst:.2e}");
    assert!(batch_worst < 1e-5, "batch decode does not match per-session decode");

    match check(unsafe { kvs_session_decode(s.0, 9, &t1, &tkn, &tvn, &to, &tl, ptr::null_mut()) }) {
        Err((code, msg)) if code == KVS_STATUS_INVALID_ARGUMENT => println!("rust: error handled: code {code}: {msg}"),
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
}

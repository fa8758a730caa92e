// SPDX-License-Identifier: Apache-2.0
//! The safe crate against the installed library: decodes, prefills and appends checked against
//! softmax attention computed here in f64 on random inputs, a batch checked against per-session
//! decodes, save/load, forks, method listing, and errors with their status.
use kvsieve::{Backend, Batch, LoadParams, LseBase, PagedKv, ScalarType, Session, SessionParams, Status};

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;

/// xorshift64*: uniform floats in [-1, 1).
struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
                ((x >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
            })
            .collect()
    }
}

/// Softmax attention in f64 of query rows against the first `ctx` keys of k, v (`[T, HKV, D]`),
/// grouped query heads (head h reads kv head h / (HQ / HKV)). Returns (o `[HQ, D]`, lse `[HQ]`).
fn reference(q: &[f32], k: &[f32], v: &[f32], ctx: usize) -> (Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (D as f64).sqrt();
    let (mut o, mut lse) = (vec![0f64; HQ * D], vec![0f64; HQ]);
    for h in 0..HQ {
        let kh = h / (HQ / HKV);
        let s: Vec<f64> = (0..ctx)
            .map(|j| scale * (0..D).map(|c| q[h * D + c] as f64 * k[(j * HKV + kh) * D + c] as f64).sum::<f64>())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        lse[h] = m + z.ln();
        for c in 0..D {
            o[h * D + c] = (0..ctx).map(|j| w[j] * v[(j * HKV + kh) * D + c] as f64).sum::<f64>() / z;
        }
    }
    (o, lse)
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

fn full_params(layers: u32) -> SessionParams {
    SessionParams::new(layers, HQ as u32, HKV as u32, D as u32).method("full").kv_dtype(ScalarType::F32)
}

#[test]
fn full_prefill_decode_append_match_f64_reference() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    const N: usize = 40;
    const M: usize = 3; // tokens appended after one decode step
    let total = N + 1 + M;
    let (q, k, v) = (rng.vec(total * HQ * D), rng.vec(total * HKV * D), rng.vec(total * HKV * D));
    let row = |t: &[f32], i: usize, h: usize| t[i * h * D..(i + 1) * h * D].to_vec();

    let mut s = Session::new(&full_params(1)).expect("create");
    assert_eq!(s.shape().num_q_heads, HQ as u32);
    // prefill in two chunks; o is causal attention of each prompt token over the prompt so far
    let mut o_pre = vec![f32::NAN; N * HQ * D];
    let split = 25;
    let (o1, o2) = o_pre.split_at_mut(split * HQ * D);
    s.prefill(0, &q[..split * HQ * D], &k[..split * HKV * D], &v[..split * HKV * D], Some(o1)).expect("prefill 1");
    s.prefill(
        0,
        &q[split * HQ * D..N * HQ * D],
        &k[split * HKV * D..N * HKV * D],
        &v[split * HKV * D..N * HKV * D],
        Some(o2),
    )
    .expect("prefill 2");
    let mut worst = 0f64;
    for i in 0..N {
        let (o_ref, _) = reference(&row(&q, i, HQ), &k, &v, i + 1);
        worst = worst.max(max_diff(&o_pre[i * HQ * D..(i + 1) * HQ * D], &o_ref));
    }
    assert!(worst < 1e-4, "prefill o vs f64 causal reference: {worst:e}");
    s.build_index().expect("build_index");
    assert_eq!(s.layer_tokens(0).unwrap(), N as i64);

    // one decode step: the new key joins the context
    let (mut o, mut lse) = (vec![f32::NAN; HQ * D], vec![f32::NAN; HQ]);
    s.decode(0, &row(&q, N, HQ), &row(&k, N, HKV), &row(&v, N, HKV), &mut o, Some(&mut lse)).expect("decode");
    let (o_ref, lse_ref) = reference(&row(&q, N, HQ), &k, &v, N + 1);
    let (eo, el) = (max_diff(&o, &o_ref), max_diff(&lse, &lse_ref));
    assert!(eo < 1e-4 && el < 1e-4, "decode vs f64 reference: o {eo:e}, lse {el:e}");
    // the values are not trivially small: a wrong kernel could not pass by outputting zeros
    assert!(o_ref.iter().any(|x| x.abs() > 0.05));

    // append M tokens: exact causal attention over the whole context
    let mut o_app = vec![f32::NAN; M * HQ * D];
    let a = N + 1;
    s.append(0, &q[a * HQ * D..], &k[a * HKV * D..], &v[a * HKV * D..], Some(&mut o_app)).expect("append");
    let mut worst = 0f64;
    for i in 0..M {
        let (o_ref, _) = reference(&row(&q, a + i, HQ), &k, &v, a + i + 1);
        worst = worst.max(max_diff(&o_app[i * HQ * D..(i + 1) * HQ * D], &o_ref));
    }
    assert!(worst < 1e-4, "append o vs f64 reference: {worst:e}");
    assert_eq!(s.layer_tokens(0).unwrap(), total as i64);
    let st = s.stats().unwrap();
    assert_eq!(st.tokens, total as i64);
    assert_eq!(st.decode_steps, 1);
}

/// Two 2-layer quest sessions (a real selection: a quarter of the context) decode three tokens
/// through a batch; forks taken before decode the same tokens one session at a time.
#[test]
fn batch_matches_per_session_decodes() {
    const L: u32 = 2;
    const B: usize = 2;
    let mut rng = Rng(42);
    let params =
        SessionParams::new(L, HQ as u32, HKV as u32, D as u32).method("quest").kv_dtype(ScalarType::F32).budget(0.25);
    let mut sessions = Vec::new();
    let mut forks = Vec::new();
    for b in 0..B {
        let n = 48 + 16 * b; // different prompt lengths
        let mut s = Session::new(&params).expect("create");
        let (q, k, v) = (rng.vec(n * HQ * D), rng.vec(n * HKV * D), rng.vec(n * HKV * D));
        for layer in 0..L {
            s.prefill(layer, &q, &k, &v, None).expect("prefill");
        }
        s.build_index().expect("build_index");
        forks.push(s.fork().expect("fork"));
        sessions.push(s);
    }
    let mut batch = Batch::new(sessions.iter_mut()).expect("batch");
    assert_eq!(batch.len(), B);
    let mut worst = 0f64;
    for _token in 0..3 {
        batch.plan().expect("plan");
        for layer in 0..L {
            let (q, k, v) = (rng.vec(B * HQ * D), rng.vec(B * HKV * D), rng.vec(B * HKV * D));
            let (mut o, mut lse) = (vec![f32::NAN; B * HQ * D], vec![f32::NAN; B * HQ]);
            batch.decode(layer, &q, &k, &v, &mut o, Some(&mut lse)).expect("batch decode");
            if layer == 0 {
                let e = batch.decode(0, &q, &k, &v, &mut o, Some(&mut lse)).unwrap_err();
                assert_eq!(e.status(), Status::InvalidState, "a layer decoded twice under one plan: {e}");
            }
            for (b, f) in forks.iter_mut().enumerate() {
                let (mut ob, mut lb) = (vec![f32::NAN; HQ * D], vec![f32::NAN; HQ]);
                f.decode(
                    layer,
                    &q[b * HQ * D..(b + 1) * HQ * D],
                    &k[b * HKV * D..(b + 1) * HKV * D],
                    &v[b * HKV * D..(b + 1) * HKV * D],
                    &mut ob,
                    Some(&mut lb),
                )
                .expect("decode");
                let o64: Vec<f64> = ob.iter().map(|&x| x as f64).collect();
                let l64: Vec<f64> = lb.iter().map(|&x| x as f64).collect();
                worst = worst.max(max_diff(&o[b * HQ * D..(b + 1) * HQ * D], &o64));
                worst = worst.max(max_diff(&lse[b * HQ..(b + 1) * HQ], &l64));
                assert!(o64.iter().all(|x| x.is_finite()) && o64.iter().any(|x| x.abs() > 1e-3));
            }
        }
    }
    assert!(worst < 1e-5, "batch vs per-session decodes: {worst:e}");
    // the sessions come back and decode on their own
    let back = batch.into_sessions();
    assert_eq!(back.len(), B);
    assert!(back[0].stats().unwrap().decode_steps == 3 * L as i64);
}

/// A batch of two `full` sessions against the f64 reference directly.
#[test]
fn batch_of_full_sessions_matches_f64_reference() {
    let mut rng = Rng(7);
    const N: usize = 30;
    let mut ctx = Vec::new();
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let mut s = Session::new(&full_params(1)).unwrap();
        let (q, k, v) = (rng.vec(N * HQ * D), rng.vec(N * HKV * D), rng.vec(N * HKV * D));
        s.prefill(0, &q, &k, &v, None).unwrap();
        s.build_index().unwrap();
        sessions.push(s);
        ctx.push((k, v));
    }
    let mut batch = Batch::new(sessions.iter_mut()).unwrap();
    batch.plan().unwrap();
    let (q, kn, vn) = (rng.vec(2 * HQ * D), rng.vec(2 * HKV * D), rng.vec(2 * HKV * D));
    let mut o = vec![f32::NAN; 2 * HQ * D];
    batch.decode(0, &q, &kn, &vn, &mut o, None).unwrap();
    for (b, (k, v)) in ctx.iter_mut().enumerate() {
        k.extend_from_slice(&kn[b * HKV * D..(b + 1) * HKV * D]);
        v.extend_from_slice(&vn[b * HKV * D..(b + 1) * HKV * D]);
        let (o_ref, _) = reference(&q[b * HQ * D..(b + 1) * HQ * D], k, v, N + 1);
        let e = max_diff(&o[b * HQ * D..(b + 1) * HQ * D], &o_ref);
        assert!(e < 1e-4, "batch element {b} vs f64 reference: {e:e}");
    }
}

#[test]
fn save_load_fork_round_trip() {
    let mut rng = Rng(1234);
    const N: usize = 64;
    let params =
        SessionParams::new(2, HQ as u32, HKV as u32, D as u32).method("quest").kv_dtype(ScalarType::F32).budget(0.3);
    let mut s = Session::new(&params).unwrap();
    let (q, k, v) = (rng.vec(N * HQ * D), rng.vec(N * HKV * D), rng.vec(N * HKV * D));
    for layer in 0..2 {
        s.prefill(layer, &q, &k, &v, None).unwrap();
    }
    s.build_index().unwrap();
    let dir = std::env::temp_dir().join(format!("kvsieve-rs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.kvt");
    s.save(&path, true).expect("save");
    let desc = kvsieve::tables_describe(&path).expect("describe");
    assert!(desc.contains("\"quest\""), "{desc}");
    let mut l = Session::load(&path, &LoadParams::default()).expect("load");
    assert_eq!(l.shape(), s.shape());
    let mut f = s.fork().unwrap();
    let (q1, k1, v1) = (rng.vec(HQ * D), rng.vec(HKV * D), rng.vec(HKV * D));
    let mut outs = Vec::new();
    for x in [&mut s, &mut l, &mut f] {
        let mut o = vec![f32::NAN; HQ * D];
        x.decode(1, &q1, &k1, &v1, &mut o, None).unwrap();
        outs.push(o);
    }
    assert_eq!(outs[0], outs[1], "loaded session decodes as the saved one");
    assert_eq!(outs[0], outs[2], "fork decodes as its parent");
    let sel = l.last_selection(1, 0).unwrap();
    assert!(!sel.is_empty() && sel.len() < N + 1 && sel.windows(2).all(|w| w[0] < w[1]), "{sel:?}");
    // a corrupt file: the library's format error
    let bytes = std::fs::read(&path).unwrap();
    let bad = dir.join("bad.kvt");
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let e = Session::load(&bad, &LoadParams::default()).unwrap_err();
    assert!(matches!(e.status(), Status::FormatTruncated | Status::FormatInvalid | Status::FormatChecksum), "{e}");
    let e = Session::load(dir.join("missing.kvt"), &LoadParams::default()).unwrap_err();
    assert_eq!(e.status(), Status::Io, "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn errors_carry_status_and_message() {
    let mut rng = Rng(99);
    // a head_dim the library refuses
    let e = Session::new(&SessionParams::new(1, 4, 2, 3)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(e.code(), kvsieve_sys::KVS_STATUS_INVALID_ARGUMENT as i32);
    assert!(e.message().contains("head_dim"), "{e}");
    // an unknown method
    let e = Session::new(&full_params(1).method("no-such-method")).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");

    let mut s = Session::new(&full_params(1)).unwrap();
    let (q, k, v) = (rng.vec(HQ * D), rng.vec(HKV * D), rng.vec(HKV * D));
    let mut o = vec![0f32; HQ * D];
    // decode before prefill
    let e = s.decode(0, &q, &k, &v, &mut o, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidState, "{e}");
    s.prefill(0, &rng.vec(8 * HQ * D), &rng.vec(8 * HKV * D), &rng.vec(8 * HKV * D), None).unwrap();
    s.build_index().unwrap();
    // an out-of-range layer
    let e = s.decode(5, &q, &k, &v, &mut o, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.message().contains("layer"), "{e}");
    // q of the wrong number of heads: the library's shape check
    let e = s.decode(0, &q[..2 * D], &k, &v, &mut o, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // a slice that is not a whole number of rows: refused before the call
    let e = s.decode(0, &q[..D + 1], &k, &v, &mut o, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // nothing changed: the session still decodes
    s.decode(0, &q, &k, &v, &mut o, None).unwrap();
    assert_eq!(s.layer_tokens(0).unwrap(), 9);
    // a NUL inside a string
    let e = Session::new(&full_params(1).method("fu\0ll")).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    // a batch of sessions of different shapes
    let mut other =
        Session::new(&SessionParams::new(1, 2, 2, D as u32).method("full").kv_dtype(ScalarType::F32)).unwrap();
    let e = Batch::new(vec![&mut s, &mut other]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    let e = Batch::new(Vec::new()).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // decode before plan
    let mut b = Batch::new(vec![&mut s]).unwrap();
    let e = b.decode(0, &q, &k, &v, &mut o, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidState, "{e}");
    assert!(format!("{e}").contains("kvs_batch_decode"), "{e}");
}

#[test]
fn methods_are_listed() {
    let names = kvsieve::methods();
    assert!(names.iter().any(|m| m == "full") && names.iter().any(|m| m == "quest"), "{names:?}");
    for m in &names {
        assert!(kvsieve::method_doc(m).is_some(), "{m} has no doc");
        assert!(
            kvsieve::method_backends(m).contains(&Backend::Cpu)
                || kvsieve::method_unsupported_reason(m, Backend::Cpu).is_some()
        );
        kvsieve::method_params(m).unwrap_or_else(|e| panic!("{m}: {e}"));
    }
    assert_eq!(kvsieve::method_unsupported_reason("quest", Backend::Cpu), None);
    assert!(kvsieve::method_doc("no-such-method").is_none());
    let e = kvsieve::method_params("no-such-method").unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(kvsieve::version().starts_with("0."));
    kvsieve::abi_check().unwrap();
}

/// A session decoded on its own between the batch's plan and its decode (the header allows use on
/// its own between tokens): whatever the library answers, the results it gives are right. (It
/// answers with a correct decode: the batch step re-reserves what the session's own steps used.)
#[test]
fn session_used_between_plan_and_decode() {
    let mut rng = Rng(3);
    const N: usize = 20;
    let (k0, v0) = (rng.vec(N * HKV * D), rng.vec(N * HKV * D));
    let mut s = Session::new(&full_params(1)).unwrap();
    s.prefill(0, &rng.vec(N * HQ * D), &k0, &v0, None).unwrap();
    s.build_index().unwrap();
    let (mut k, mut v) = (k0, v0);
    let mut batch = Batch::new(vec![&mut s]).unwrap();
    batch.plan().unwrap();
    for _ in 0..40 {
        let (q, kn, vn) = (rng.vec(HQ * D), rng.vec(HKV * D), rng.vec(HKV * D));
        let mut o = vec![f32::NAN; HQ * D];
        batch.session_mut(0).decode(0, &q, &kn, &vn, &mut o, None).unwrap();
        k.extend_from_slice(&kn);
        v.extend_from_slice(&vn);
        let e = max_diff(&o, &reference(&q, &k, &v, k.len() / (HKV * D)).0);
        assert!(e < 1e-4, "decode on its own: {e:e}");
    }
    let (q, kn, vn) = (rng.vec(HQ * D), rng.vec(HKV * D), rng.vec(HKV * D));
    let mut o = vec![f32::NAN; HQ * D];
    match batch.decode(0, &q, &kn, &vn, &mut o, None) {
        Ok(()) => {
            k.extend_from_slice(&kn);
            v.extend_from_slice(&vn);
            let e = max_diff(&o, &reference(&q, &k, &v, k.len() / (HKV * D)).0);
            assert!(e < 1e-4, "batch decode after the session moved on: {e:e}");
        }
        Err(e) => assert_eq!(e.status(), Status::InvalidState, "{e}"),
    }
}

/// Truncate drops decoded tokens: the next step equals a session that never saw them (csattention,
/// whose rollback replays its history); out of range is refused naming the argument; lse base 2.
#[test]
fn truncate_rolls_back_and_lse_base_two() {
    let mut rng = Rng(0x5151_2121_7777_0001);
    const N: usize = 64;
    let (q, k, v) = (rng.vec((N + 3) * HQ * D), rng.vec((N + 3) * HKV * D), rng.vec((N + 3) * HKV * D));
    let row = |t: &[f32], i: usize, h: usize| t[i * h * D..(i + 1) * h * D].to_vec();
    let params =
        SessionParams::new(1, HQ as u32, HKV as u32, D as u32).method("csattention").budget(0.5).max_rollback(4);
    let start = |p: &SessionParams| {
        let mut s = Session::new(p).expect("create");
        s.prefill(0, &q[..N * HQ * D], &k[..N * HKV * D], &v[..N * HKV * D], None).expect("prefill");
        s.build_index().expect("build_index");
        s
    };
    let step = |s: &mut Session, t: usize| {
        let (mut o, mut lse) = (vec![f32::NAN; HQ * D], vec![f32::NAN; HQ]);
        s.decode(0, &row(&q, t, HQ), &row(&k, t, HKV), &row(&v, t, HKV), &mut o, Some(&mut lse)).expect("decode");
        (o, lse)
    };
    let mut a = start(&params);
    step(&mut a, N);
    step(&mut a, N + 1);
    a.truncate(N as i64 + 1).expect("truncate");
    assert_eq!(a.layer_tokens(0).unwrap(), N as i64 + 1);
    let e = a.truncate(N as i64 + 5).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.message().contains("num_tokens"), "{e}");
    let (oa, la) = step(&mut a, N + 2);
    let mut b = start(&params.clone().lse_base(LseBase::Two));
    step(&mut b, N);
    let (ob, lb) = step(&mut b, N + 2);
    assert_eq!(oa, ob, "a rolled-back session decodes as one that never saw the dropped token");
    for h in 0..HQ {
        let want = la[h] as f64 / std::f64::consts::LN_2;
        assert!((lb[h] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "lse base 2: {} vs {want}", lb[h]);
    }
}

/// A session over the caller's paged cache (kv_from_caller, bind_kv, the `_bound` calls) decodes as
/// one storing the same tokens, to the bit; its tables load back into a caller session.
#[test]
fn caller_kv_matches_an_owned_session() {
    let mut rng = Rng(0x5151_2121_7777_0002);
    const N: usize = 300;
    const P: usize = 256; // the cpu backend's page size
    let (q, k, v) = (rng.vec((N + 2) * HQ * D), rng.vec((N + 2) * HKV * D), rng.vec((N + 2) * HKV * D));
    let row = |t: &[f32], i: usize, h: usize| t[i * h * D..(i + 1) * h * D].to_vec();
    // The engine's pool: 3 pages of [2][Hkv][P][d] f32; the sequence lives in pages 2 then 0.
    let mut pool = vec![f32::NAN; 3 * 2 * HKV * P * D];
    let table = [2i32, 0];
    for t in 0..N + 2 {
        let page = table[t / P] as usize;
        for h in 0..HKV {
            for j in 0..D {
                pool[((page * 2) * HKV + h) * P * D + (t % P) * D + j] = k[(t * HKV + h) * D + j];
                pool[((page * 2 + 1) * HKV + h) * P * D + (t % P) * D + j] = v[(t * HKV + h) * D + j];
            }
        }
    }
    let params = SessionParams::new(1, HQ as u32, HKV as u32, D as u32)
        .method("quest")
        .budget(0.3)
        .kv_dtype(ScalarType::F32)
        .num_threads(1);
    let mut own = Session::new(&params).expect("create owned");
    let mut cal = Session::new(&params.clone().kv_from_caller(true)).expect("create caller");
    own.prefill(0, &q[..N * HQ * D], &k[..N * HKV * D], &v[..N * HKV * D], None).expect("prefill owned");
    let e = cal.prefill_bound(0, &q[..N * HQ * D], None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidState, "nothing bound yet: {e}");
    // SAFETY: `pool` outlives both sessions and the tokens they count are not written again.
    unsafe { cal.bind_kv(0, &PagedKv::host(&pool, 3, P as i32, &table, N as i64), std::ptr::null_mut()) }
        .expect("bind_kv");
    cal.prefill_bound(0, &q[..N * HQ * D], None).expect("prefill caller");
    own.build_index().expect("build owned");
    cal.build_index().expect("build caller");
    let dir = std::env::temp_dir().join(format!("kvsieve-rust-caller-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("quest.kvs");
    own.save(&path, false).expect("save");
    let mut ld = Session::load(&path, &LoadParams::default().kv_from_caller(true)).expect("load into a caller session");
    assert_eq!(ld.layer_tokens(0).unwrap(), 0);
    for t in N..N + 2 {
        let (mut o1, mut o2, mut o3) = (vec![0f32; HQ * D], vec![1f32; HQ * D], vec![2f32; HQ * D]);
        own.decode(0, &row(&q, t, HQ), &row(&k, t, HKV), &row(&v, t, HKV), &mut o1, None).expect("decode owned");
        let kv = PagedKv::host(&pool, 3, P as i32, &table, t as i64 + 1);
        // SAFETY: as above.
        unsafe { cal.bind_kv(0, &kv, std::ptr::null_mut()) }.expect("bind_kv");
        cal.decode_bound(0, &row(&q, t, HQ), &mut o2, None).expect("decode caller");
        if t == N {
            unsafe { ld.bind_kv(0, &PagedKv::host(&pool, 3, P as i32, &table, N as i64), std::ptr::null_mut()) }
                .expect("bind_kv loaded");
            ld.prefill_bound(0, &q[..N * HQ * D], None).expect("prefill the loaded session again");
        }
        unsafe { ld.bind_kv(0, &kv, std::ptr::null_mut()) }.expect("bind_kv loaded");
        ld.decode_bound(0, &row(&q, t, HQ), &mut o3, None).expect("decode loaded");
        assert_eq!(o1, o2, "token {t}: the caller session decodes as the owned one");
        assert_eq!(o1, o3, "token {t}: the loaded caller session decodes as the saver");
    }
    assert_eq!(cal.stats().unwrap().kv_bytes, 0);
    let e =
        cal.decode(0, &row(&q, N, HQ), &row(&k, N, HKV), &row(&v, N, HKV), &mut vec![0f32; HQ * D], None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "k/v given to a caller session: {e}");
    let _ = std::fs::remove_dir_all(&dir);
}

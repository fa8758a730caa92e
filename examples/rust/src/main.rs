// SPDX-License-Identifier: Apache-2.0
//! kvsieve from Rust through the safe `kvsieve` crate: a prefill and a decode checked against an
//! f64 reference, a batch of two sessions (plan per token, decode per layer) checked against
//! per-session decodes of forks, and an error.
use kvsieve::{Backend, Batch, ScalarType, Session, SessionParams, Status};

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;

fn main() -> Result<(), kvsieve::Error> {
    let mut seed = 12345u32;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1103515245).wrapping_add(12345);
                ((seed >> 8) & 0xffff) as f32 / 32768.0 - 1.0
            })
            .collect()
    };

    // one layer, method "full": the decode is dense attention over the prompt and the new token
    const N: usize = 64;
    let params = SessionParams::new(1, HQ as u32, HKV as u32, D as u32).method("full").kv_dtype(ScalarType::F32);
    let mut s = Session::new(&params)?;
    let (q, k, v) = (rnd(N * HQ * D), rnd((N + 1) * HKV * D), rnd((N + 1) * HKV * D));
    s.prefill(0, &q, &k[..N * HKV * D], &v[..N * HKV * D], None)?;
    s.build_index()?;
    let q1 = rnd(HQ * D);
    let (mut o, mut lse) = (vec![0f32; HQ * D], vec![0f32; HQ]);
    s.decode(0, &q1, &k[N * HKV * D..], &v[N * HKV * D..], &mut o, Some(&mut lse))?;
    let scale = 1.0 / (D as f64).sqrt();
    let mut worst = 0f64;
    for h in 0..HQ {
        let kh = h / (HQ / HKV);
        let sc: Vec<f64> = (0..=N)
            .map(|j| scale * (0..D).map(|c| q1[h * D + c] as f64 * k[(j * HKV + kh) * D + c] as f64).sum::<f64>())
            .collect();
        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        worst = worst.max((m + sum.ln() - lse[h] as f64).abs());
        for c in 0..D {
            let acc: f64 = (0..=N).map(|j| (sc[j] - m).exp() * v[(j * HKV + kh) * D + c] as f64).sum();
            worst = worst.max((acc / sum - o[h * D + c] as f64).abs());
        }
    }
    println!("rust: kvsieve {}: decode max |error| vs f64 reference = {worst:.2e}", kvsieve::version());
    assert!(worst < 1e-4, "decode does not match the reference");

    // a batch of two 2-layer quest sessions against forks decoding one session at a time
    if let Some(why) = kvsieve::method_unsupported_reason("quest", Backend::Hybrid) {
        println!("rust: quest on hybrid: {why}");
    }
    const L: u32 = 2;
    let params =
        SessionParams::new(L, HQ as u32, HKV as u32, D as u32).method("quest").kv_dtype(ScalarType::F32).budget(0.25);
    let (mut sessions, mut forks) = (Vec::new(), Vec::new());
    for b in 0..2 {
        let n = 48 + 16 * b;
        let mut s = Session::new(&params)?;
        let (q, k, v) = (rnd(n * HQ * D), rnd(n * HKV * D), rnd(n * HKV * D));
        for layer in 0..L {
            s.prefill(layer, &q, &k, &v, None)?;
        }
        s.build_index()?;
        forks.push(s.fork()?);
        sessions.push(s);
    }
    let mut batch = Batch::new(sessions.iter_mut())?;
    let mut batch_worst = 0f32;
    for _token in 0..3 {
        batch.plan()?;
        for layer in 0..L {
            let (q, k, v) = (rnd(2 * HQ * D), rnd(2 * HKV * D), rnd(2 * HKV * D));
            let mut o = vec![0f32; 2 * HQ * D];
            batch.decode(layer, &q, &k, &v, &mut o, None)?;
            for (b, f) in forks.iter_mut().enumerate() {
                let mut ob = vec![0f32; HQ * D];
                let (qb, kb, vb) =
                    (&q[b * HQ * D..][..HQ * D], &k[b * HKV * D..][..HKV * D], &v[b * HKV * D..][..HKV * D]);
                f.decode(layer, qb, kb, vb, &mut ob, None)?;
                batch_worst = ob.iter().zip(&o[b * HQ * D..]).fold(batch_worst, |w, (x, y)| w.max((x - y).abs()));
            }
        }
    }
    drop(batch);
    println!("rust: batch of 2 sessions, 3 tokens x 2 layers: max |batch - per-session decode| = {batch_worst:.2e}");
    assert!(batch_worst < 1e-5, "batch decode does not match per-session decode");

    // errors come back as kvsieve::Error with the library's status and message
    match s.decode(9, &q1, &k[N * HKV * D..], &v[N * HKV * D..], &mut o, None) {
        Err(e) if e.status() == Status::InvalidArgument => println!("rust: error handled: {e}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    Ok(())
}

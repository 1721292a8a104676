//! Which 512-bit instructions share the slots `vpdpbusd` runs in: rounds of 12 independent
//! `vpdpbusd` chains with `K` independent chains of another instruction beside them, in cycles
//! per round at the CPU's measured `vpdpbusd` rate (one a cycle on a Zen 4, so 12 cycles for
//! the chains alone; an instruction that fits beside them adds nothing).
//!
//! `cargo run --release -p forge-kernels --example slots` (x86-64 with AVX-512 VBMI/VNNI).

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::time::Instant;

    const ROUNDS: usize = 2_000_000;

    #[inline(always)]
    unsafe fn other<const OP: u32>(v: __m512i, t: __m512i) -> __m512i {
        match OP {
            1 => _mm512_permutexvar_epi8(v, t),
            2 => _mm512_multishift_epi64_epi8(t, v),
            3 => _mm512_srli_epi16::<3>(v),
            4 => _mm512_add_epi32(v, t),
            5 => _mm512_shuffle_epi8(t, v),
            _ => _mm512_ternarylogic_epi32::<0xE4>(v, t, t),
        }
    }

    /// `D` chains of `vpdpbusd` and `K` of instruction `OP`, `ROUNDS` times.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    unsafe fn run<const D: usize, const OP: u32, const K: usize>() -> i64 {
        let (b, c, t) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2), _mm512_set1_epi8(7));
        let mut a: [__m512i; 12] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
        let mut p: [__m512i; 12] = std::array::from_fn(|i| _mm512_set1_epi8(i as i8));
        for _ in 0..std::hint::black_box(ROUNDS) {
            for i in 0..12 {
                if i < D {
                    a[i] = _mm512_dpbusd_epi32(a[i], b, c);
                }
                if i < K {
                    p[i] = other::<OP>(p[i], t);
                }
            }
        }
        a.iter().chain(&p).map(|&v| _mm512_reduce_add_epi32(v) as i64).sum()
    }

    /// One timed case: the instructions' chains, `ROUNDS` times.
    type Case = unsafe fn() -> i64;

    fn seconds(f: Case) -> f64 {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                // SAFETY: `main` checked the AVX-512 subsets these functions enable.
                std::hint::black_box(unsafe { f() });
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    pub fn main() {
        if !forge_kernels::simd::has_avx512_kernels() {
            println!("needs AVX-512 F/BW/VBMI/VNNI");
            return;
        }
        let base = seconds(run::<12, 0, 0>);
        // One `vpdpbusd` a cycle on a Zen 4: its rate alone sets the cycle.
        let cyc = |s: f64| 12.0 * s / base;
        println!("cycles per round (12 vpdpbusd alone = 12)");
        let cases: [(&str, Case); 10] = [
            ("+ 4 vpermb", run::<12, 1, 4>),
            ("+ 8 vpermb", run::<12, 1, 8>),
            ("+ 12 vpermb", run::<12, 1, 12>),
            ("+ 4 vpmultishiftqb", run::<12, 2, 4>),
            ("+ 4 vpsrlw", run::<12, 3, 4>),
            ("+ 4 vpaddd", run::<12, 4, 4>),
            ("+ 4 vpshufb", run::<12, 5, 4>),
            ("+ 4 vpternlogd", run::<12, 6, 4>),
            ("12 vpermb alone", run::<0, 1, 12>),
            ("12 vpmultishiftqb alone", run::<0, 2, 12>),
        ];
        for (name, f) in cases {
            println!("{name:24} {:.1}", cyc(seconds(f)));
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
}

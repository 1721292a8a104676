//! Test support shared with the server's tests: a model whose projections all run on the INT8
//! integer-dot kernels.

use forge_kernels::lut::Int8Matrix;
use forge_model::linear::Weight;
use forge_model::Model;
use std::sync::Arc;

/// Every layer's projections as per-row absmax INT8 (the packed integer-dot path).
pub fn int8(mut m: Model) -> Model {
    for l in 0..m.cfg.num_layers {
        for lin in m.layer_linears_mut(l) {
            let w = match &lin.weight {
                Weight::Dense(w) => w.to_f32_vec().unwrap(),
                _ => continue,
            };
            let (cout, cin) = (lin.out_f, lin.in_f);
            let mut q = vec![0i8; cout * cin];
            let mut scale = vec![0f32; cout];
            for r in 0..cout {
                let row = &w[r * cin..(r + 1) * cin];
                let s = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                scale[r] = if s > 0.0 { s } else { 1.0 };
                for (qi, v) in q[r * cin..].iter_mut().zip(row) {
                    *qi = (v / scale[r]).round().clamp(-127.0, 127.0) as i8;
                }
            }
            lin.weight = Weight::Int8(Arc::new(Int8Matrix { cout, cin, q, scale }));
        }
    }
    m
}

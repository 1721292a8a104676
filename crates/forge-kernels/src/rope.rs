//! Rotary position embeddings in the `rotate_half` layout used by Hugging Face checkpoints
//! (llama.cpp's interleaved layout is undone when a GGUF is loaded).

use forge_core::config::RopeScaling;

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Leading dims of each head that rotate; the rest pass through (partial rotary).
    pub rotary_dim: usize,
}

impl Rope {
    pub fn new(theta: f32, rotary_dim: usize, scaling: Option<&RopeScaling>) -> Self {
        let mut inv_freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / rotary_dim as f64)) as f32)
            .collect();
        match scaling {
            Some(RopeScaling::Linear { factor }) => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => {
                let low_wavelen = original_max_position / low_freq_factor;
                let high_wavelen = original_max_position / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if medium {
                        let smooth =
                            (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
            None => {}
        }
        Rope { inv_freq, rotary_dim }
    }

    /// cos/sin of each frequency at `pos`, computed like transformers (f32 product).
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let a = pos as f32 * f;
            cos[i] = a.cos();
            sin[i] = a.sin();
        }
    }

    /// Rotate one head vector in place given precomputed cos/sin.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dim / 2;
        for i in 0..half {
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i] + a * sin[i];
        }
    }

    pub fn n_freq(&self) -> usize {
        self.inv_freq.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn rotation_is_norm_preserving_and_relative() {
        let r = Rope::new(10000.0, 8, None);
        let (mut c, mut s) = (vec![0.0; 4], vec![0.0; 4]);
        let q: Vec<f32> = (0..10).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..10).map(|i| (i as f32 * 0.91).cos()).collect();
        let rot = |v: &[f32], p: usize, c: &mut Vec<f32>, s: &mut Vec<f32>| {
            let mut v = v.to_vec();
            r.cos_sin(p, c, s);
            r.apply(&mut v, c, s);
            v
        };
        let q5 = rot(&q, 5, &mut c, &mut s);
        assert!((q5.iter().map(|x| x * x).sum::<f32>() - q.iter().map(|x| x * x).sum::<f32>()).abs() < 1e-5);
        assert_eq!(&q5[8..], &q[8..]); // partial rotary: tail untouched
                                       // <R(p)q, R(p')k> depends only on p - p'.
        let d1: f32 = rot(&q, 7, &mut c, &mut s).iter().zip(rot(&k, 3, &mut c, &mut s)).map(|(a, b)| a * b).sum();
        let d2: f32 = rot(&q, 14, &mut c, &mut s).iter().zip(rot(&k, 10, &mut c, &mut s)).map(|(a, b)| a * b).sum();
        assert!((d1 - d2).abs() < 1e-4);
    }
}

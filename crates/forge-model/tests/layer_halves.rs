//! A layer run as its two halves (the token mixer, then the MLP) gives the bits of the whole
//! layer, in both model families: the quantizer's calibration passes run them apart.

use forge_model::load::load;
use forge_model::{Model, Session};
use std::path::PathBuf;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name);
    load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}")).model
}

#[test]
fn mixer_then_mlp_is_the_whole_layer() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        let m = fixture(name);
        let t = 37;
        let prompt = forge_model::generate::synthetic_prompt(m.cfg.vocab_size, t);
        let mut x = m.embed(&prompt).unwrap();
        let fresh = Session::new(&m.cfg);
        for l in 0..m.cfg.num_layers {
            let mut whole = x.clone();
            m.forward_layer(l, &mut fresh.layers[l].clone(), &mut whole, t, 0).unwrap();
            let mut halves = x.clone();
            m.forward_mixer(l, &mut fresh.layers[l].clone(), &mut halves, t, 0).unwrap();
            assert_ne!(halves, x, "{name} layer {l}: the mixer changed nothing");
            m.forward_mlp(l, &mut halves).unwrap();
            assert_eq!(halves, whole, "{name} layer {l}");
            x = whole;
        }
    }
}

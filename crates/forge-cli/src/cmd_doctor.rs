//! `forge doctor`: what this machine will run and whether a model fits, one line per check,
//! each OK, WARN or FAIL with the fix.

use anyhow::{bail, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::config::{LayerKind, ModelConfig};
use forge_model::export::{is_export, Export};
use forge_model::session::KvDtype;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// A model to check (short name, bundle, export, Hugging Face directory or GGUF file).
    #[arg(long)]
    model: Option<String>,
    /// Context length to budget the KV cache for (default: the model's maximum).
    #[arg(long)]
    ctx_size: Option<usize>,
    /// The server port to check (forge serve's default: 8765).
    #[arg(long, default_value_t = 8765)]
    port: u16,
    /// Print the checks as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, serde::Serialize)]
pub struct Check {
    pub name: &'static str,
    pub level: Level,
    pub detail: String,
    /// What to do about a WARN or FAIL.
    pub fix: String,
}

fn check(name: &'static str, level: Level, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { name, level, detail: detail.into(), fix: fix.into() }
}

pub fn run(a: Args) -> Result<()> {
    let mut checks = vec![cpu(), threads()];
    let avail = available_memory();
    checks.push(disk(&forge_core::hub::forge_home(), "disk (FORGE_HOME)"));
    checks.push(data_dir());
    if let Some(m) = &a.model {
        model_checks(m, a.ctx_size, avail, &mut checks);
    } else {
        checks.push(memory_only(avail));
    }
    checks.push(port(a.port));
    if a.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        for c in &checks {
            let tag = match c.level {
                Level::Ok => "OK  ",
                Level::Warn => "WARN",
                Level::Fail => "FAIL",
            };
            println!("{tag} {:<18} {}", c.name, c.detail);
            if c.level != Level::Ok && !c.fix.is_empty() {
                println!("     {:<18} fix: {}", "", c.fix);
            }
        }
    }
    let fails = checks.iter().filter(|c| c.level == Level::Fail).count();
    if fails > 0 {
        bail!("{fails} check(s) failed");
    }
    Ok(())
}

fn cpu() -> Check {
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let isa = forge_kernels::lutmm::intdot::isa();
    let detail =
        format!("{name}; decode kernels {isa}; prefill kernels {}", forge_kernels::lutmm::intdot::prefill_isa());
    if isa.starts_with("portable") {
        check(
            "cpu",
            Level::Warn,
            detail,
            "this CPU has neither AVX2+FMA nor NEON: Forge runs its portable kernels, several times slower",
        )
    } else {
        check("cpu", Level::Ok, detail, "")
    }
}

fn threads() -> Check {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::current_num_threads();
    let detail = format!("{pool} worker threads on {cores} available cores");
    if pool > cores {
        check("threads", Level::Warn, detail, format!("--threads {cores}: more workers than cores slows decode"))
    } else {
        check("threads", Level::Ok, detail, "")
    }
}

/// MemAvailable, capped by a cgroup's limit where one is set.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    let mut avail = kb * 1024;
    if let Some(limit) =
        std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| s.trim().parse::<u64>().ok())
    {
        let used = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
        avail = avail.min(limit.saturating_sub(used));
    }
    Some(avail)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn memory_only(avail: Option<u64>) -> Check {
    match avail {
        Some(a) => check("memory", Level::Ok, format!("{} available", gib(a)), ""),
        None => check("memory", Level::Warn, "cannot read /proc/meminfo", "check free memory by hand"),
    }
}

/// Whether `need` bytes fit in `avail`, with a tenth kept for the system and scratch.
pub fn fit(need: u64, avail: Option<u64>, what: &str) -> Check {
    let Some(avail) = avail else {
        return check("memory", Level::Warn, format!("{what} needs {}; available memory unknown", gib(need)), "");
    };
    let detail = format!("{what} needs {} of {} available", gib(need), gib(avail));
    if need > avail {
        check(
            "memory",
            Level::Fail,
            detail,
            "a smaller --ctx-size, --kv-cache-dtype kv8, v8 or f16, or a lower-bit export",
        )
    } else if need > avail / 10 * 9 {
        check("memory", Level::Warn, detail, "little headroom: a smaller --ctx-size or --kv-cache-dtype kv8")
    } else {
        check("memory", Level::Ok, detail, "")
    }
}

/// Bytes the KV cache takes per position, over every attention layer.
pub fn kv_bytes_per_position(cfg: &ModelConfig, dtype: &str) -> u64 {
    let attn = cfg.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count() as u64;
    let (kvh, hd) = (cfg.num_kv_heads as u64, cfg.head_dim as u64);
    // f16: 2 × 2 bytes a value; v8: f16 keys, i8 values and an f32 scale; kv8: i8 keys and
    // values, each with an f16 scale.
    let per_head = KvDtype::parse(dtype).unwrap_or_default().bytes_per_position(hd as usize) as u64;
    attn * kvh * per_head
}

/// The DeltaNet layers' recurrent and conv state (f32), fixed whatever the context.
pub fn recurrent_bytes(cfg: &ModelConfig) -> u64 {
    let Some(d) = &cfg.deltanet else { return 0 };
    let layers = cfg.layer_kinds.iter().filter(|k| **k == LayerKind::DeltaNet).count() as u64;
    let state = (d.num_v_heads * d.k_head_dim * d.v_head_dim) as u64;
    let conv = (d.conv_dim() * d.conv_kernel) as u64;
    layers * (state + conv) * 4
}

/// Resident bytes of the weights once loaded: an export's packed matrices (mapped from the
/// compiled cache, or built at load) and its embedding; a GGUF's tensors dequantized to f32; a
/// Hugging Face directory's mapped files.
fn weight_bytes(path: &Path, cfg: &ModelConfig) -> Result<u64> {
    if is_export(path) {
        let ex = Export::open(path)?;
        let embed = (cfg.vocab_size * cfg.hidden_size * 2) as u64;
        return Ok(ex.packing_bytes() + embed);
    }
    let (ck, _) = Checkpoint::open(path)?;
    Ok(match &ck {
        Checkpoint::Gguf { file, .. } => file.tensors.iter().map(|t| t.n_elements() * 4).sum(),
        Checkpoint::Hf { dir, .. } => forge_core::release::list_files(dir)?
            .iter()
            .filter(|f| f.ends_with(".safetensors"))
            .map(|f| std::fs::metadata(dir.join(f)).map_or(0, |m| m.len()))
            .sum(),
    })
}

fn model_checks(arg: &str, ctx: Option<usize>, avail: Option<u64>, out: &mut Vec<Check>) {
    let bundle = Path::new(arg);
    if forge_core::release::is_bundle(bundle) {
        out.push(match forge_core::release::open_model(bundle, true) {
            Ok(_) => check("bundle", Level::Ok, format!("{arg}: every file matches release.json"), ""),
            Err(e) => check(
                "bundle",
                Level::Fail,
                format!("{e:#}").replace('\n', " "),
                format!("download the bundle again, or `forge verify {arg} --full` for the report"),
            ),
        });
    }
    let path = match forge_core::hub::resolve_model_with(arg, false, false) {
        Ok(p) => p,
        Err(e) => {
            out.push(check("model", Level::Fail, format!("{e:#}"), "`forge fetch` for smollm2, or a path that exists"));
            return;
        }
    };
    let cfg_path = if is_export(&path) { Export::open(&path).and_then(|e| e.source()) } else { Ok(path.clone()) };
    let cfg = match cfg_path.and_then(|p| Checkpoint::open(&p).map(|(_, c)| c)) {
        Ok(c) => c,
        Err(e) => {
            out.push(check(
                "model",
                Level::Fail,
                format!("{e:#}"),
                "check the model path; `forge inspect` shows an export",
            ));
            return;
        }
    };
    out.push(check(
        "model",
        Level::Ok,
        format!("{} ({}, {} layers, vocab {})", path.display(), cfg.model_type, cfg.num_layers, cfg.vocab_size),
        "",
    ));
    if is_export(&path) {
        out.push(match Export::open(&path) {
            Ok(ex) if ex.is_compiled() => {
                check("compiled cache", Level::Ok, "packed.forgecache matches the export", "")
            }
            Ok(_) => check(
                "compiled cache",
                Level::Warn,
                "none: the kernel layout is rebuilt at every start",
                format!("forge compile --model {}", path.display()),
            ),
            Err(e) => check("compiled cache", Level::Fail, format!("{e:#}"), "forge compile again"),
        });
    }
    let ctx = ctx.unwrap_or(cfg.max_position_embeddings.max(1));
    let weights = weight_bytes(&path, &cfg).unwrap_or(0);
    for dtype in ["f32", "f16", "v8", "kv8"] {
        let kv = kv_bytes_per_position(&cfg, dtype) * ctx as u64;
        let need = weights + kv + recurrent_bytes(&cfg);
        let mut c = fit(need, avail, &format!("weights {} + KV {dtype} at {ctx} tokens {}", gib(weights), gib(kv)));
        c.name = match dtype {
            "f32" => "memory (kv f32)",
            "f16" => "memory (kv f16)",
            "v8" => "memory (kv v8)",
            _ => "memory (kv kv8)",
        };
        out.push(c);
    }
}

/// Free space where Forge keeps models (`df`, which every Unix has).
fn disk(dir: &Path, name: &'static str) -> Check {
    let mut probe: PathBuf = dir.to_path_buf();
    while !probe.exists() {
        match probe.parent() {
            Some(p) => probe = p.to_path_buf(),
            None => break,
        }
    }
    let out = std::process::Command::new("df").arg("-Pk").arg(&probe).output();
    let free = out.ok().and_then(|o| {
        let t = String::from_utf8_lossy(&o.stdout).to_string();
        t.lines().nth(1)?.split_whitespace().nth(3)?.parse::<u64>().ok().map(|k| k * 1024)
    });
    match free {
        Some(f) if f < (2 << 30) => check(
            name,
            Level::Warn,
            format!("{}: {} free", dir.display(), gib(f)),
            "free space or set FORGE_HOME elsewhere",
        ),
        Some(f) => check(name, Level::Ok, format!("{}: {} free", dir.display(), gib(f)), ""),
        None => check(name, Level::Warn, format!("{}: free space unknown (no df)", dir.display()), ""),
    }
}

fn data_dir() -> Check {
    match forge_quant::eval::find_data_dir() {
        Some(d) => check("data", Level::Ok, format!("calibration and evaluation text in {}", d.display()), ""),
        None => check(
            "data",
            Level::Warn,
            "data/ not found: quantize needs --calib files by path, eval needs --data-dir",
            "run forge from the repository, or pass the paths",
        ),
    }
}

/// Whether the server could listen on `port` on the loopback address.
pub fn port(port: u16) -> Check {
    match std::net::TcpListener::bind(("127.0.0.1", port)) {
        Ok(_) => check("port", Level::Ok, format!("127.0.0.1:{port} is free for forge serve"), ""),
        Err(e) => check(
            "port",
            Level::Fail,
            format!("127.0.0.1:{port}: {e}"),
            format!("stop what listens there, or forge serve --port {}", port.wrapping_add(1)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_fits_warns_and_fails_at_its_bounds() {
        assert_eq!(fit(8 << 30, Some(24 << 30), "m").level, Level::Ok);
        assert_eq!(fit(23 << 30, Some(24 << 30), "m").level, Level::Warn);
        assert_eq!(fit(25 << 30, Some(24 << 30), "m").level, Level::Fail);
        assert_eq!(fit(1, None, "m").level, Level::Warn);
    }

    #[test]
    fn a_busy_port_fails_and_a_free_one_passes() {
        let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let busy = l.local_addr().unwrap().port();
        let c = port(busy);
        assert_eq!(c.level, Level::Fail);
        assert!(c.fix.contains("--port"));
        drop(l);
        assert_eq!(port(busy).level, Level::Ok);
    }
}

//! Tuned recipes behind `forge quantize --preset`. Each names a plan, rotations, GPTQ with
//! calibration from data/calib and low-rank corrections; docs/presets.md records why
//! and what each measured.

use crate::plan::Plan;
use anyhow::{bail, Result};
use forge_kernels::lut::Format;

pub struct Preset {
    pub name: &'static str,
    pub plan: Plan,
    pub rotate: &'static str,
    pub aw: bool,
    pub lowrank: usize,
    pub lowrank_parts: &'static str,
}

impl Preset {
    pub fn get(name: &str) -> Result<Preset> {
        let mk = |mlp: Format, mixer: Format, kv: Format, head: Format| {
            let mut p = Plan::uniform(mlp);
            p.mixer = mixer;
            p.kv = kv;
            p.head = head;
            p
        };
        Ok(match name {
            "q4" => Preset {
                name: "q4",
                plan: mk(Format::Lut4, Format::Lut4, Format::Lut4, Format::Lut4),
                rotate: "mlp,mixer,head",
                aw: true,
                lowrank: 0,
                lowrank_parts: "gdn,attn",
            },
            "q3" => Preset {
                name: "q3",
                plan: mk(Format::Vec2x64, Format::Vec2x64, Format::Vec2x64, Format::Vec2x64),
                rotate: "mlp,mixer,head",
                aw: true,
                lowrank: 0,
                lowrank_parts: "gdn,attn",
            },
            "q2" => Preset {
                name: "q2",
                plan: mk(Format::Vec2x16, Format::Vec2x64, Format::Vec2x64, Format::Vec2x64),
                rotate: "mlp,mixer,head",
                aw: true,
                lowrank: 0,
                lowrank_parts: "gdn,attn",
            },
            _ => bail!("unknown preset '{name}' (q4, q3, q2)"),
        })
    }
}

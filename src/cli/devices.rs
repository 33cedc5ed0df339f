//! `metashard devices`: the devices of every built-in registry, or of one device list, as a
//! table (name, kind, memory, description) or a JSON array.

use super::JsonArgs;
use metashard::{Result, parse_devices};

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help(
    "Print a JSON array (name, kind, description, memory) instead of a table"
)))]
pub struct DevicesArgs {
    /// A device list: `cpu`, `cpu:N`, `cpu:NxT`.
    #[arg(long)]
    pub devices: Option<String>,
    #[command(flatten)]
    pub out: JsonArgs,
}

pub fn run(a: &DevicesArgs) -> Result<()> {
    let devices = match a.devices.as_deref() {
        Some(s) => parse_devices(s)?,
        None => metashard::devices::registries()
            .iter()
            .flat_map(|r| r.devices())
            .collect(),
    };
    let rows: Vec<serde_json::Value> = devices
        .iter()
        .map(|d| {
            let m = d.memory();
            serde_json::json!({
                "name": d.name(),
                "kind": format!("{:?}", d.kind()),
                "description": d.description(),
                "memory_total": m.total,
                "memory_free": m.free,
            })
        })
        .collect();
    if a.out.json {
        println!("{}", serde_json::Value::Array(rows));
    } else {
        println!(
            "{:<8} {:<6} {:>12} {:>12}  description",
            "name", "kind", "total MiB", "free MiB"
        );
        for r in rows {
            println!(
                "{:<8} {:<6} {:>12} {:>12}  {}",
                r["name"].as_str().unwrap_or(""),
                r["kind"].as_str().unwrap_or(""),
                r["memory_total"].as_u64().unwrap_or(0) / 1048576,
                r["memory_free"].as_u64().unwrap_or(0) / 1048576,
                r["description"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}

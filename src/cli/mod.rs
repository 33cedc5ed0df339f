//! Command implementations shared by the `metashard` binary: opening a device set (one device,
//! or a meta device over several with a split callback), progress bars, memory summaries.

pub mod embed;
pub mod run;
pub mod verify;

use crate::Result;
use crate::backend::{Backend, Device, parse_devices};
use crate::buffer::{Buffer, BufferType};
use crate::cpu::{CpuOptions, Precision, parse_cpu_spec_with};
use crate::meta::{MetaBuffer, MetaDevice, MetaOptions, SplitFn};
use std::sync::Arc;

/// The devices a command runs on.
pub struct DeviceSet {
    pub spec: String,
    pub devices: Vec<Arc<dyn Device>>,
    pub backend: Arc<dyn Backend>,
    pub buffer_type: Arc<dyn BufferType>,
    /// Set when running on several devices.
    pub meta: Option<Arc<MetaDevice>>,
}

impl DeviceSet {
    /// Open `spec` (`cpu`, `cpu:N`, `cpu:NxT`) with `precision` for products of quantized
    /// weights on CPU devices; several devices run as one meta device with `split` (called only
    /// then).
    pub fn open(
        spec: &str,
        precision: Precision,
        explicit: bool,
        split: impl FnOnce(usize) -> SplitFn,
    ) -> Result<DeviceSet> {
        let devices = if spec.trim().starts_with("cpu") {
            parse_cpu_spec_with(spec, CpuOptions { precision })?
        } else {
            parse_devices(spec)?
        };
        if devices.len() == 1 {
            let d = devices[0].clone();
            return Ok(DeviceSet {
                spec: spec.to_string(),
                backend: d.init_backend()?,
                buffer_type: d.buffer_type(),
                devices,
                meta: None,
            });
        }
        let m = MetaDevice::with_options(
            devices.clone(),
            split(devices.len()),
            MetaOptions { explicit },
        )?;
        Ok(DeviceSet {
            spec: spec.to_string(),
            backend: m.init_backend()?,
            buffer_type: m.buffer_type(),
            devices,
            meta: Some(m),
        })
    }

    pub fn names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.name()).collect()
    }

    /// Bytes per device held by `buffers` (split buffers count each device's slices).
    pub fn bytes_per_device(&self, buffers: &[&Arc<dyn Buffer>]) -> Vec<usize> {
        let mut v = vec![0; self.devices.len()];
        for b in buffers {
            match b.as_any().downcast_ref::<MetaBuffer>() {
                Some(mb) => mb
                    .device_bytes()
                    .iter()
                    .enumerate()
                    .for_each(|(d, x)| v[d] += x),
                None => v[0] += b.size(),
            }
        }
        v
    }
}

/// A progress bar on stderr for `total` bytes (hidden when stderr is not a terminal).
pub fn bytes_bar(total: usize, msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:<22} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A per-device memory table.
pub fn memory_table(names: &[String], rows: &[(&str, Vec<usize>)]) -> String {
    let mut s = format!("{:<10}", "device");
    for (label, _) in rows {
        s += &format!(" {label:>12}");
    }
    s += &format!(" {:>12}\n", "total MiB");
    for (d, name) in names.iter().enumerate() {
        s += &format!("{name:<10}");
        let mut total = 0;
        for (_, v) in rows {
            let x = v.get(d).copied().unwrap_or(0);
            total += x;
            s += &format!(" {:>12.2}", x as f64 / 1048576.0);
        }
        s += &format!(" {:>12.2}\n", total as f64 / 1048576.0);
    }
    s
}

//! CPU registry and devices. `cpu` is one device using every core; `cpu:N` makes N logical
//! devices splitting the cores; `cpu:NxT` makes N devices of T threads each (N up to 16, and
//! N x T up to [`max_total_threads`]: 4 per core and at least 64 unless `METASHARD_MAX_THREADS`
//! says otherwise).
//! Each device's backend owns its own thread pool, so N devices run at the same time, which is
//! how tensor parallelism runs and is tested on one host.

use super::backend::CpuBackend;
use super::buffer::CpuBufferType;
use super::view::Precision;
use crate::backend::{Backend, Device, DeviceCaps, DeviceKind, MemoryInfo, Registry};
use crate::buffer::BufferType;
use crate::graph::{Graph, TensorId};
use crate::{Error, Result};
use std::any::Any;
use std::sync::Arc;

/// Most logical CPU devices in one list.
pub const MAX_CPU_DEVICES: usize = 16;

/// The environment variable that sets the most threads a CPU device list may start in all
/// (devices x threads per device), overriding [`default_max_threads`].
pub const MAX_THREADS_ENV: &str = "METASHARD_MAX_THREADS";

/// The default limit on a device list's threads in all: 4 per logical core of this host, and
/// at least 64. More only oversubscribes the cores (every thread spins at each barrier), and
/// thousands exhaust the system's thread and memory limits.
pub fn default_max_threads() -> usize {
    (4 * host_threads()).max(64)
}

/// The limit on a device list's threads in all: `METASHARD_MAX_THREADS` when set, else
/// [`default_max_threads`]. An error names the variable when it is not a positive integer.
pub fn max_total_threads() -> Result<usize> {
    match std::env::var(MAX_THREADS_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(default_max_threads()),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(Error::invalid_argument(
                MAX_THREADS_ENV,
                format!("{v:?}"),
                "must be a positive integer (the most threads a device list may start)",
            )),
        },
        Err(e) => Err(Error::invalid_argument(
            MAX_THREADS_ENV,
            "(not UTF-8)",
            e.to_string(),
        )),
    }
}

/// Options shared by the devices of one spec.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// Precision of activations in products with quantized weights.
    pub precision: Precision,
}

impl CpuOptions {
    /// f32 activations everywhere ([`Precision::Exact`]).
    pub fn exact() -> Self {
        CpuOptions {
            precision: Precision::Exact,
        }
    }

    pub fn with_precision(precision: Precision) -> Self {
        CpuOptions { precision }
    }
}

/// One logical CPU device.
#[derive(Debug)]
pub struct CpuDevice {
    pub index: usize,
    pub count: usize,
    pub threads: usize,
    pub options: CpuOptions,
}

impl CpuDevice {
    pub fn new(index: usize, count: usize, threads: usize, options: CpuOptions) -> Self {
        CpuDevice {
            index,
            count,
            threads: threads.max(1),
            options,
        }
    }
}

/// Logical cores of this host.
pub fn host_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Total and available host memory from /proc/meminfo (zeros where unknown).
fn host_memory() -> MemoryInfo {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |key: &str| -> usize {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    MemoryInfo {
        free: field("MemAvailable:"),
        total: field("MemTotal:"),
    }
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        if self.count == 1 {
            "cpu".into()
        } else {
            format!("cpu{}", self.index)
        }
    }

    fn description(&self) -> String {
        format!(
            "logical CPU device {} of {}, {} thread{}{}",
            self.index,
            self.count,
            self.threads,
            if self.threads == 1 { "" } else { "s" },
            match self.options.precision {
                Precision::Q8 => ", 8-bit activations for quantized weights",
                Precision::Exact => "",
            }
        )
    }

    /// The host's memory, shared by the logical devices: each is shown an equal share.
    fn memory(&self) -> MemoryInfo {
        let m = host_memory();
        MemoryInfo {
            free: m.free / self.count,
            total: m.total / self.count,
        }
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            async_io: false,
            host_buffer: true,
            events: false,
        }
    }

    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(CpuBufferType)
    }

    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(CpuBackend::new(CpuDevice::new(
            self.index,
            self.count,
            self.threads,
            self.options,
        ))?))
    }

    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String> {
        super::backend::supports_node(graph, id)
    }

    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        bt.is_host()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The CPU registry: one device using every core.
#[derive(Default)]
pub struct CpuRegistry;

impl Registry for CpuRegistry {
    fn name(&self) -> &str {
        "CPU"
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        vec![Arc::new(CpuDevice::new(
            0,
            1,
            host_threads(),
            CpuOptions::default(),
        ))]
    }
}

/// Parse `cpu`, `cpu:N` or `cpu:NxT` into N logical devices.
pub fn parse_cpu_spec(spec: &str) -> Result<Vec<Arc<dyn Device>>> {
    parse_cpu_spec_with(spec, CpuOptions::default())
}

/// As [`parse_cpu_spec`], with options for every device.
pub fn parse_cpu_spec_with(spec: &str, options: CpuOptions) -> Result<Vec<Arc<dyn Device>>> {
    let bad = |reason: String| Error::Device {
        device: spec.to_string(),
        reason,
    };
    let (n, t) = match spec.trim().strip_prefix("cpu") {
        Some("") => (1, host_threads()),
        Some(rest) => {
            let rest = rest
                .strip_prefix(':')
                .ok_or_else(|| bad("expected `cpu`, `cpu:N` or `cpu:NxT`".into()))?;
            let parse = |s: &str, what: &str| {
                s.parse::<usize>()
                    .map_err(|_| bad(format!("{what} `{s}` is not a positive integer")))
            };
            match rest.split_once(['x', 'X']) {
                Some((n, t)) => (parse(n, "device count")?, parse(t, "threads per device")?),
                None => {
                    let n = parse(rest, "device count")?;
                    (n, (host_threads() / n.max(1)).max(1))
                }
            }
        }
        None => return Err(bad("not a CPU device list".into())),
    };
    if n == 0 || n > MAX_CPU_DEVICES {
        return Err(bad(format!(
            "device count {n} must be in 1..={MAX_CPU_DEVICES}"
        )));
    }
    if t == 0 {
        return Err(bad("threads per device must be at least 1".into()));
    }
    let limit = max_total_threads()?;
    match n.checked_mul(t) {
        Some(total) if total <= limit => {}
        total => {
            let total = total.map_or("more than usize::MAX".to_string(), |x| x.to_string());
            return Err(bad(format!(
                "{n} device{} x {t} threads = {total} threads, more than the limit of {limit} \
                 (default: 4 per logical core of this host, {}, and at least 64); set \
                 {MAX_THREADS_ENV}={total} to start them anyway",
                if n == 1 { "" } else { "s" },
                host_threads()
            )));
        }
    }
    Ok((0..n)
        .map(|i| Arc::new(CpuDevice::new(i, n, t, options)) as Arc<dyn Device>)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings() {
        let d = parse_cpu_spec("cpu:3x2").unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d[2].name(), "cpu2");
        assert!(d[0].description().contains("2 threads"));
        assert_eq!(parse_cpu_spec("cpu").unwrap().len(), 1);
        assert_eq!(parse_cpu_spec("cpu:4").unwrap().len(), 4);
        for bad in ["cpu:0", "cpu:17", "cpu:2x0", "cpu:ax1", "cpu2", "cpu:"] {
            let e = parse_cpu_spec(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad} must fail"));
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}

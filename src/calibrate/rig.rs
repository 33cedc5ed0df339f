//! The timing rig of the device measurements: each device's backend and one worker per device
//! (pinned as the meta device pins its workers); a graph per device computed once and planned,
//! then every device's plan run at the same time, timed from the first device starting to the
//! last one finishing.

use super::options::STALL_TIMEOUT;
use crate::backend::{Backend, Device, GraphPlan};
use crate::buffer::BufferType;
use crate::graph::Graph;
use crate::workers::{DeviceWorkers, Job, Outcome, Progress};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

/// Each device's backend and a worker per device (pinned as the meta device pins them).
pub(super) struct Rig {
    pub devices: Vec<Arc<dyn Device>>,
    backends: Vec<Arc<dyn Backend>>,
    workers: DeviceWorkers,
}

/// What [`Rig::time`] measured, in seconds per timed run.
pub(super) struct Timings {
    /// From the first device starting to the last one finishing.
    pub spans: Vec<f64>,
    /// Each device's own time, every device and run.
    pub device: Vec<f64>,
}

/// One graph per device, computed once (allocation, uploads, pages touched) and planned.
pub(super) struct Prepared {
    plans: Vec<Arc<Mutex<Box<dyn GraphPlan>>>>,
    lens: Vec<usize>,
    /// The graphs own the bindings the plans compute over.
    _graphs: Vec<Graph>,
}

impl Rig {
    pub fn new(devices: &[Arc<dyn Device>]) -> Result<Rig> {
        Ok(Rig {
            backends: devices
                .iter()
                .map(|d| d.init_backend())
                .collect::<Result<_>>()?,
            workers: DeviceWorkers::new(devices.len(), "calibrate")?,
            devices: devices.to_vec(),
        })
    }

    /// `build(device index, its buffer type)` on every device, computed once and planned.
    pub fn prepare(
        &self,
        build: &dyn Fn(usize, &dyn BufferType) -> Result<Graph>,
    ) -> Result<Prepared> {
        let (mut plans, mut lens, mut graphs) = (Vec::new(), Vec::new(), Vec::new());
        for (d, (dev, be)) in self.devices.iter().zip(&self.backends).enumerate() {
            let mut g = build(d, dev.buffer_type().as_ref())?;
            be.graph_compute(&mut g)?;
            plans.push(Arc::new(Mutex::new(be.graph_plan(&g)?)));
            lens.push(g.len());
            graphs.push(g);
        }
        Ok(Prepared {
            plans,
            lens,
            _graphs: graphs,
        })
    }

    /// Run every device's plan at the same time, `warmup + reps` times; the seconds of each
    /// timed run, from the first device starting to the last one finishing (what a step
    /// waits for; devices sharing cores or memory slow each other down in it).
    pub fn time(&mut self, p: &Prepared, warmup: usize, reps: usize) -> Result<Timings> {
        let n = self.devices.len();
        let mut times = Timings {
            spans: Vec::with_capacity(reps),
            device: Vec::with_capacity(n * reps),
        };
        type Span = Option<Result<(Instant, Instant)>>;
        for rep in 0..warmup + reps {
            let slots: Vec<Arc<Mutex<Span>>> = (0..n).map(|_| Arc::new(Mutex::new(None))).collect();
            let jobs: Vec<Job> = (0..n)
                .map(|d| {
                    let (plan, len, slot) = (p.plans[d].clone(), p.lens[d], slots[d].clone());
                    Box::new(move |prog: &Progress| {
                        prog.stage(0, false);
                        let mut plan = plan.lock();
                        let t = Instant::now();
                        let r = plan.compute(0..len).map(|()| (t, Instant::now()));
                        *slot.lock() = Some(r);
                    }) as Job
                })
                .collect();
            match self.workers.run(jobs, STALL_TIMEOUT, &|_| {})? {
                Outcome::Done => {}
                Outcome::Stalled { devices, .. } => {
                    return Err(Error::Device {
                        device: self.devices[devices[0]].name(),
                        reason: format!(
                            "a calibration graph ran longer than {STALL_TIMEOUT:?}; abandoned"
                        ),
                    });
                }
            }
            let mut spans = Vec::with_capacity(n);
            for (d, slot) in slots.iter().enumerate() {
                spans.push(slot.lock().take().unwrap_or_else(|| {
                    Err(Error::Device {
                        device: self.devices[d].name(),
                        reason: "a calibration job returned no timing".into(),
                    })
                })?);
            }
            let first = spans
                .iter()
                .map(|s| s.0)
                .min()
                .expect("at least one device");
            let last = spans
                .iter()
                .map(|s| s.1)
                .max()
                .expect("at least one device");
            if rep >= warmup {
                times.spans.push((last - first).as_secs_f64());
                times
                    .device
                    .extend(spans.iter().map(|s| (s.1 - s.0).as_secs_f64()));
            }
        }
        Ok(times)
    }
}

/// The median of `v` (NaN when empty).
pub(super) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

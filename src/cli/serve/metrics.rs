//! `GET /metrics` of `metashard serve`: the engine's counters as of its last step, the bytes
//! each device holds (weights and KV cache) and how long requests waited for a slot (a
//! histogram), in Prometheus' text exposition format
//! (prometheus.io/docs/instrumenting/exposition_formats), every name prefixed `metashard_`.

use super::{AppState, authorized};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use metashard::models::engine::{Engine, WAIT_BUCKETS, WaitHistogram};
use std::fmt::Write;
use std::sync::Arc;

/// What the engine thread publishes after each step (and each refusal).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Gauges {
    requests: u64,
    /// Requests refused because the queue was full.
    pub(super) rejected: u64,
    running: usize,
    queued: usize,
    steps: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    last_step_secs: f64,
    queue_wait: WaitHistogram,
}

impl Gauges {
    /// Take `e`'s counters after a step of `step_secs`.
    pub(super) fn publish(&mut self, e: &Engine, step_secs: f64) {
        self.requests = e.stats.requests;
        self.running = e.running();
        self.queued = e.queued();
        self.steps = e.stats.steps;
        self.prompt_tokens = e.stats.prompt_tokens;
        self.generated_tokens = e.stats.generated_tokens;
        self.last_step_secs = step_secs;
        self.queue_wait = e.stats.queue_wait;
    }
}

/// Bytes each device holds, fixed once the server started.
#[derive(Clone, Debug)]
pub(super) struct Memory {
    pub(super) devices: Vec<String>,
    pub(super) weights: Vec<usize>,
    pub(super) kv_cache: Vec<usize>,
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&state, &headers) {
        return r;
    }
    let g = *state.gauges.lock();
    let text = render(&g, &state.memory, state.slots, state.max_queue);
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// A label value with `\`, `"` and newlines escaped, as the format asks.
fn label(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

fn render(g: &Gauges, mem: &Memory, slots: usize, max_queue: usize) -> String {
    let rows: [(&str, &str, &str, f64); 10] = [
        (
            "requests_total",
            "counter",
            "requests accepted",
            g.requests as f64,
        ),
        (
            "requests_rejected_total",
            "counter",
            "requests refused with 429 because the queue was full",
            g.rejected as f64,
        ),
        (
            "requests_running",
            "gauge",
            "requests holding a slot",
            g.running as f64,
        ),
        (
            "requests_queued",
            "gauge",
            "requests waiting for a slot",
            g.queued as f64,
        ),
        ("slots", "gauge", "KV cache slots", slots as f64),
        (
            "max_queue",
            "gauge",
            "requests allowed to wait (--max-queue)",
            max_queue as f64,
        ),
        (
            "steps_total",
            "counter",
            "batched steps run",
            g.steps as f64,
        ),
        (
            "prompt_tokens_total",
            "counter",
            "prompt tokens evaluated",
            g.prompt_tokens as f64,
        ),
        (
            "generated_tokens_total",
            "counter",
            "tokens generated",
            g.generated_tokens as f64,
        ),
        (
            "step_seconds",
            "gauge",
            "time of the last step",
            g.last_step_secs,
        ),
    ];
    let mut out = String::new();
    let help = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(
            out,
            "# HELP metashard_{name} {help}\n# TYPE metashard_{name} {kind}"
        );
    };
    for (name, kind, text, v) in rows {
        help(&mut out, name, kind, text);
        let _ = writeln!(out, "metashard_{name} {v}");
    }
    help(
        &mut out,
        "device_memory_bytes",
        "gauge",
        "bytes a device holds, by kind: weights, kv_cache",
    );
    for (i, d) in mem.devices.iter().enumerate() {
        for (kind, bytes) in [("weights", &mem.weights), ("kv_cache", &mem.kv_cache)] {
            let _ = writeln!(
                out,
                "metashard_device_memory_bytes{{device=\"{}\",index=\"{i}\",kind=\"{kind}\"}} {}",
                label(d),
                bytes.get(i).copied().unwrap_or(0)
            );
        }
    }
    let q = &g.queue_wait;
    help(
        &mut out,
        "queue_seconds",
        "histogram",
        "seconds from a request's arrival to its KV cache slot",
    );
    for (b, n) in WAIT_BUCKETS.iter().zip(&q.le) {
        let _ = writeln!(out, "metashard_queue_seconds_bucket{{le=\"{b}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "metashard_queue_seconds_bucket{{le=\"+Inf\"}} {}",
        q.count
    );
    let _ = writeln!(out, "metashard_queue_seconds_sum {}", q.sum);
    let _ = writeln!(out, "metashard_queue_seconds_count {}", q.count);
    out
}

#[cfg(test)]
mod tests {
    use super::{Gauges, Memory, render};

    #[test]
    fn the_text_names_every_device_and_bucket() {
        let mut g = Gauges::default();
        g.queue_wait.observe(0.02);
        g.queue_wait.observe(3.0);
        let mem = Memory {
            devices: vec!["cpu0".into(), "cpu\"1".into()],
            weights: vec![100, 200],
            kv_cache: vec![10, 20],
        };
        let t = render(&g, &mem, 8, 64);
        for line in [
            "metashard_slots 8",
            "metashard_max_queue 64",
            "metashard_device_memory_bytes{device=\"cpu0\",index=\"0\",kind=\"weights\"} 100",
            "metashard_device_memory_bytes{device=\"cpu\\\"1\",index=\"1\",kind=\"kv_cache\"} 20",
            "# TYPE metashard_queue_seconds histogram",
            "metashard_queue_seconds_bucket{le=\"0.01\"} 0",
            "metashard_queue_seconds_bucket{le=\"0.025\"} 1",
            "metashard_queue_seconds_bucket{le=\"+Inf\"} 2",
            "metashard_queue_seconds_count 2",
        ] {
            assert!(t.lines().any(|l| l == line), "{line} missing from\n{t}");
        }
    }
}

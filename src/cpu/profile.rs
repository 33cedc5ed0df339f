//! Where a CPU step's time goes, node by node (`METASHARD_CPU_PROFILE=1`): each thread times
//! its share of every node and its wait at the barrier after it; the times add up per node
//! name with layer numbers folded (`l7.attn_norm` and `l8.attn_norm` are one row, `l#.attn_norm`)
//! and are printed to stderr, slowest first, when a CPU device's backend is dropped. ggml's
//! `GGML_PERF` counters served the same purpose. Off, it costs one relaxed load per range.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;

/// Whether `METASHARD_CPU_PROFILE` is set to anything but `0` or empty.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("METASHARD_CPU_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// Sums of one row of the profile.
#[derive(Clone, Copy, Default)]
struct Row {
    /// Times the node ran (one per range, not per thread).
    calls: u64,
    /// Nanoseconds of compute, summed over threads.
    compute_ns: u64,
    /// Nanoseconds spent waiting at the barrier after the node, summed over threads.
    wait_ns: u64,
    /// Runs with a barrier after the node (the others let threads go straight on).
    barriers: u64,
}

static TALLY: Mutex<Option<HashMap<(String, &'static str), Row>>> = Mutex::new(None);

/// A node name with its digit runs replaced by `#`.
fn fold(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_digits = false;
    for c in name.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

/// Add one run of a node: its name (folded), a detail appended as it is (a product's weight
/// type and shape), its op, each thread's compute and wait nanoseconds summed, and whether
/// the threads met at a barrier after it.
pub(crate) fn record(
    name: &str,
    detail: &str,
    op: &'static str,
    compute_ns: u64,
    wait_ns: u64,
    barrier: bool,
) {
    let mut t = TALLY.lock();
    let row = t
        .get_or_insert_with(HashMap::new)
        .entry((fold(name) + detail, op))
        .or_default();
    row.calls += 1;
    row.compute_ns += compute_ns;
    row.wait_ns += wait_ns;
    row.barriers += u64::from(barrier);
}

/// The profile so far as a table (slowest rows first), and clear it; `None` when empty.
pub(crate) fn take_report() -> Option<String> {
    let rows = TALLY.lock().take()?;
    let mut rows: Vec<_> = rows.into_iter().collect();
    rows.sort_by_key(|(_, r)| std::cmp::Reverse(r.compute_ns + r.wait_ns));
    let total: u64 = rows.iter().map(|(_, r)| r.compute_ns + r.wait_ns).sum();
    let mut s = format!(
        "{:<48} {:<14} {:>8} {:>9} {:>12} {:>12} {:>7}\n",
        "node (layers folded)", "op", "calls", "barriers", "compute ms", "wait ms", "share"
    );
    let (mut calls, mut barriers) = (0, 0);
    for ((name, op), r) in rows {
        s += &format!(
            "{:<48} {:<14} {:>8} {:>9} {:>12.2} {:>12.2} {:>6.1}%\n",
            name,
            op,
            r.calls,
            r.barriers,
            r.compute_ns as f64 * 1e-6,
            r.wait_ns as f64 * 1e-6,
            100.0 * (r.compute_ns + r.wait_ns) as f64 / total.max(1) as f64
        );
        calls += r.calls;
        barriers += r.barriers;
    }
    s += &format!("all nodes: {calls} runs, {barriers} with a barrier after them\n");
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_numbers_fold_and_rows_add_up() {
        assert_eq!(fold("l12.attn_norm"), "l#.attn_norm");
        assert_eq!(fold("blk.3.ffn_up.7"), "blk.#.ffn_up.#");
        record("l1.x", "", "add", 10, 1, true);
        record("l2.x", "", "add", 20, 2, false);
        record("l3.y", " [Q5_0 640x2048]", "mul_mat", 5, 0, false);
        let r = take_report().expect("rows were recorded");
        let line = r
            .lines()
            .find(|l| l.starts_with("l#.x"))
            .expect("the folded row");
        assert!(line.contains(" 2 "), "two calls: {line}");
        assert!(line.contains(" 1 "), "one of them with a barrier: {line}");
        assert!(r.contains("3 runs, 1 with a barrier"), "{r}");
        assert!(
            r.lines().any(|l| l.starts_with("l#.y [Q5_0 640x2048]")),
            "the detail is not folded: {r}"
        );
        assert!(take_report().is_none(), "taking the report clears it");
    }
}

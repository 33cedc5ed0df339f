//! Probing the host: its last-level cache size (sysfs) and its CPU's model name
//! (`/proc/cpuinfo`), both Linux; unknown elsewhere.

/// Bytes of this host's last-level cache (Linux sysfs), if known.
pub(super) fn last_level_cache() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("size")) else {
            continue;
        };
        let t = text.trim();
        let bytes = if let Some(k) = t.strip_suffix('K') {
            k.parse::<usize>().ok().map(|v| v << 10)
        } else if let Some(m) = t.strip_suffix('M') {
            m.parse::<usize>().ok().map(|v| v << 20)
        } else {
            t.parse::<usize>().ok()
        };
        best = best.max(bytes);
    }
    best
}

/// The host CPU's model name (Linux `/proc/cpuinfo`).
pub(super) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

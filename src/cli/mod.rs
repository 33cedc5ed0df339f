//! Command implementations of the `metashard` binary (not part of the library, so a user of
//! the crate does not pull clap and indicatif): `run`, `verify`, `embed`, progress bars and
//! memory summaries. What they compute lives in the library (`devices`, `models::open`,
//! `verify`).

pub mod embed;
pub mod run;
pub mod verify;

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

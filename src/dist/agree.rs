//! What the ranks of a job must share before they compute together, over any communicator
//! (the MPI one with ranks as processes; the in-process one in tests):
//!
//! - [`agree`]: every rank checks that it was given what rank 0 was given of everything that
//!   changes the math or the shapes (the model file's identity, the split, the precision, the
//!   context, the command, this binary's version). Rank 0 broadcasts its settings; every rank
//!   compares them with its own and all-gathers a fixed-size verdict (the first setting that
//!   differs and its value there); then every rank fails alike, with `Error::RankFailed`
//!   naming the first rank that differs, the setting, and both values. It runs before any
//!   weight is loaded.
//! - [`share_from_leader`]: rank 0 owns the request (a prompt's tokens, sampling settings,
//!   step counts): its bytes are broadcast and every rank uses them, so ranks given different
//!   prompts or seeds cannot mix them into one answer.

use super::{Dist, job_communicator, startup_timeout};
use crate::backend::SliceLayout;
use crate::buffer::host::HostBufferType;
use crate::buffer::{BufferRange, BufferType, Storage};
use crate::collectives::Communicator;
use crate::{Error, Result};
use std::time::Duration;

/// One thing the ranks of a job must agree on: its name as the user knows it (a flag, or a
/// property such as "model file"), and this rank's value.
pub type Setting = (String, String);

/// Bytes of one rank's verdict: a flag byte, then `name\0value` of the first setting that
/// differs from rank 0's (cut to fit).
const VERDICT: usize = 512;
/// The largest payload [`share_over`] takes (a request is a few KiB).
const MAX_SHARED: usize = 1 << 28;

/// This binary's version and the features that change what it computes.
pub fn version() -> String {
    let mut v = env!("CARGO_PKG_VERSION").to_string();
    for (on, name) in [
        (cfg!(feature = "mpi"), "mpi"),
        (cfg!(feature = "cuda"), "cuda"),
    ] {
        if on {
            v += &format!("+{name}");
        }
    }
    v
}

/// Check that every rank of the job was given the same `settings` as rank 0 (and runs the
/// same [`version`]); the waits give up after [`startup_timeout`]. Without ranks as processes,
/// or with one rank, there is nothing to check.
pub fn agree(dist: Dist, settings: &[Setting]) -> Result<()> {
    if dist == Dist::Local {
        return Ok(());
    }
    let (rank, comm) = job_communicator(dist, startup_timeout()?)?;
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut all = vec![("metashard version".to_string(), version())];
    all.extend_from_slice(settings);
    agree_over(comm.as_ref(), rank, &all)
}

/// [`agree`] over the ranks of `comm`, this one being `rank`.
pub fn agree_over(comm: &dyn Communicator, rank: usize, settings: &[Setting]) -> Result<()> {
    let world = comm.world_size();
    let leader = decode(&share_over(comm, rank, encode(settings))?, world)?;
    let mine = verdict(&leader, settings);
    let local = host_range(VERDICT, Some(&mine))?;
    let full = host_range(VERDICT * world, None)?;
    let layout = SliceLayout::single(1, 1, &vec![VERDICT; world])?;
    comm.all_gather(rank, &local, &full, &layout)?;
    judge(&leader, &read(&full)?, world)
}

/// Rank 0's `bytes` on every rank of the job (rank 0 gets its own back); `timeout` bounds the
/// waits. Without ranks as processes, `bytes` itself.
pub fn share_from_leader(dist: Dist, bytes: Vec<u8>, timeout: Duration) -> Result<Vec<u8>> {
    if dist == Dist::Local {
        return Ok(bytes);
    }
    let (rank, comm) = job_communicator(dist, timeout)?;
    share_over(comm.as_ref(), rank, bytes)
}

/// [`share_from_leader`] over the ranks of `comm`: a broadcast of the length, then of the
/// bytes, from rank 0.
pub fn share_over(comm: &dyn Communicator, rank: usize, bytes: Vec<u8>) -> Result<Vec<u8>> {
    if comm.world_size() == 1 {
        return Ok(bytes);
    }
    if bytes.len() > MAX_SHARED {
        return Err(Error::invalid_argument(
            "request",
            format!("{} bytes", bytes.len()),
            format!("more than the {MAX_SHARED} bytes rank 0 may share with the other ranks"),
        ));
    }
    let len = (bytes.len() as u64).to_le_bytes();
    let r = host_range(8, Some(&len))?;
    comm.broadcast(rank, 0, &r)?;
    let len = u64::from_le_bytes(read(&r)?.try_into().expect("8 bytes"));
    let len = usize::try_from(len)
        .ok()
        .filter(|&n| n <= MAX_SHARED)
        .ok_or_else(|| Error::RankFailed {
            rank: 0,
            world: comm.world_size(),
            collective: "broadcast",
            reason: format!("it announced a request of {len} bytes (at most {MAX_SHARED})"),
        })?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let r = host_range(len, (rank == 0).then_some(&bytes[..]))?;
    comm.broadcast(rank, 0, &r)?;
    read(&r)
}

/// A host buffer of `len` bytes holding `data` (or zeros), as a collective takes it.
fn host_range(len: usize, data: Option<&[u8]>) -> Result<BufferRange> {
    let r = BufferRange::new(
        Storage::new(HostBufferType.alloc_buffer(len.max(1))?, 0),
        len,
    );
    if let Some(d) = data {
        let p = r.host_ptr()?;
        // SAFETY: `host_ptr` checked that `len` bytes from `p` lie in the fresh allocation, which
        // nothing else holds yet; at most `len` bytes are copied.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), p, d.len().min(len)) };
    }
    Ok(r)
}

/// The bytes of a host range (no collective runs on it now).
fn read(r: &BufferRange) -> Result<Vec<u8>> {
    let p = r.host_ptr()?;
    // SAFETY: `host_ptr` checked that the range lies in the host allocation, which the
    // handle keeps alive; the collective that wrote it has returned.
    Ok(unsafe { std::slice::from_raw_parts(p, r.len) }.to_vec())
}

/// `name`, value, `name`, value, ... each a u32 length and its UTF-8 bytes.
fn encode(settings: &[Setting]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in settings {
        for s in [k, v] {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
    out
}

fn decode(b: &[u8], world: usize) -> Result<Vec<Setting>> {
    let bad = || Error::RankFailed {
        rank: 0,
        world,
        collective: "start-up check",
        reason: "its settings did not decode (a different metashard binary?)".into(),
    };
    let mut strings = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let n = b
            .get(at..at + 4)
            .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")) as usize)
            .ok_or_else(bad)?;
        let s = b.get(at + 4..at + 4 + n).ok_or_else(bad)?;
        strings.push(String::from_utf8_lossy(s).into_owned());
        at += 4 + n;
    }
    if strings.len() % 2 != 0 {
        return Err(bad());
    }
    let mut it = strings.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// Rank 0's value of the setting `name`.
fn value_of<'a>(settings: &'a [Setting], name: &str) -> &'a str {
    settings
        .iter()
        .find(|(k, _)| k == name)
        .map_or("(not given)", |(_, v)| v.as_str())
}

/// This rank's verdict on rank 0's settings: all zero when they equal `mine`, else the first
/// setting that differs (by name, in this rank's order; then any rank 0 has and this rank
/// lacks) with this rank's value.
fn verdict(leader: &[Setting], mine: &[Setting]) -> [u8; VERDICT] {
    let mut out = [0u8; VERDICT];
    let differs = mine
        .iter()
        .find(|(k, v)| value_of(leader, k) != v.as_str())
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .or_else(|| {
            leader
                .iter()
                .find(|(k, _)| !mine.iter().any(|(m, _)| m == k))
                .map(|(k, _)| (k.as_str(), "(not given)"))
        });
    if let Some((k, v)) = differs {
        out[0] = 1;
        let text = format!("{k}\0{v}");
        // Cut at a character boundary.
        let mut n = text.len().min(VERDICT - 1);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        out[1..1 + n].copy_from_slice(&text.as_bytes()[..n]);
    }
    out
}

/// Every rank's verdict: an error naming the first rank that differs from rank 0, or `Ok`.
fn judge(leader: &[Setting], verdicts: &[u8], world: usize) -> Result<()> {
    let differing: Vec<(usize, String, String)> = verdicts
        .chunks(VERDICT)
        .enumerate()
        .filter(|(_, v)| v[0] != 0)
        .map(|(q, v)| {
            let text = String::from_utf8_lossy(&v[1..]);
            let text = text.trim_end_matches('\0');
            let (k, val) = text.split_once('\0').unwrap_or((text, ""));
            (q, k.to_string(), val.to_string())
        })
        .collect();
    let Some((q, name, value)) = differing.first() else {
        return Ok(());
    };
    let others = match differing.len() {
        1 => String::new(),
        2 => " (1 more rank differs)".to_string(),
        n => format!(" ({} more ranks differ)", n - 1),
    };
    Err(Error::RankFailed {
        rank: *q,
        world,
        collective: "start-up check",
        reason: format!(
            "rank {q} was given {name} `{value}`, rank 0 `{}`{others}: every rank of a job must \
             run the same command on the same model with the same split, precision and context \
             (rank 0's prompt and sampling settings are used by all)",
            value_of(leader, name)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::CpuCommunicator;
    use std::sync::Arc;

    fn settings(seed: &str, q8: &str) -> Vec<Setting> {
        vec![
            ("command".into(), "run".into()),
            ("--q8".into(), q8.into()),
            ("--seed".into(), seed.into()),
        ]
    }

    /// Every rank of an in-process communicator runs `f(rank)`; their results in rank order.
    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(&dyn Communicator, usize) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let comm: Arc<dyn Communicator> = Arc::new(
            CpuCommunicator::with_timeout(n, Duration::from_secs(20)).expect("a communicator"),
        );
        let f = Arc::new(f);
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let (comm, f) = (comm.clone(), f.clone());
                std::thread::spawn(move || f(comm.as_ref(), r))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a rank"))
            .collect()
    }

    #[test]
    fn ranks_that_agree_pass_and_one_that_differs_is_named_on_every_rank() {
        let ok = on_ranks(3, |c, r| agree_over(c, r, &settings("0", "false")));
        assert!(ok.iter().all(Result::is_ok), "{ok:?}");
        let bad = on_ranks(3, |c, r| {
            let q8 = if r == 2 { "true" } else { "false" };
            agree_over(c, r, &settings("0", q8))
        });
        for (r, e) in bad.into_iter().enumerate() {
            let e = e.expect_err("the ranks differ").to_string();
            assert!(
                e.contains("rank 2 of 3 failed (start-up check)")
                    && e.contains("rank 2 was given --q8 `true`, rank 0 `false`"),
                "rank {r}: {e}"
            );
        }
        // A setting only one side has is named too; a second differing rank is counted.
        let bad = on_ranks(3, |c, r| {
            let mut s = settings(&r.to_string(), "false");
            if r == 0 {
                s.push(("--ctx".into(), "64".into()));
            }
            agree_over(c, r, &s)
        });
        let e = bad[0].as_ref().expect_err("differ").to_string();
        assert!(
            e.contains("rank 1 was given --seed `1`, rank 0 `0` (1 more rank differs)"),
            "{e}"
        );
    }

    #[test]
    fn the_leader_s_bytes_reach_every_rank() {
        let got = on_ranks(3, |c, r| share_over(c, r, vec![r as u8; 1000 + r]).unwrap());
        assert!(
            got.iter().all(|g| *g == vec![0u8; 1000]),
            "{:?}",
            got[1].len()
        );
        let got = on_ranks(2, |c, r| share_over(c, r, Vec::new()).unwrap());
        assert!(got.iter().all(Vec::is_empty));
        // Long values are cut in the verdict at a character boundary.
        let long = "é".repeat(600);
        let v = verdict(&[], &[("x".into(), long)]);
        assert_eq!(v[0], 1);
        assert!(std::str::from_utf8(&v[1..]).is_ok());
    }
}

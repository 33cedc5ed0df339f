//! A stdout whose reader is gone before the child starts, so the child's first write meets a
//! closed pipe (no race with a reader closing late): for the tests of the quiet end on a
//! closed stdout (`tests/cli.rs`, `tests/mpi/ranks.rs`, which include this file by path).

/// A pipe's write end, its read end already closed.
pub fn closed_stdout() -> std::process::Stdio {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe writes two new descriptors into the array we own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the read end is ours and closed once; the write end becomes the Stdio's, which
    // closes it (after the child has it).
    unsafe {
        libc::close(fds[0]);
        std::process::Stdio::from(std::os::fd::OwnedFd::from_raw_fd(fds[1]))
    }
}

/// `o` (of the command `what`) ended as a closed stdout should end it: by SIGPIPE (status 141
/// in a shell), with no panic or error on stderr.
pub fn assert_ended_quietly(o: &std::process::Output, what: &[&str]) {
    use std::os::unix::process::ExitStatusExt;
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGPIPE),
        "{what:?}: {:?}\n{e}",
        o.status
    );
    assert!(
        !e.contains("panicked") && !e.contains("Broken pipe") && !e.contains("error"),
        "{what:?}: {e}"
    );
}

//! `serve --dist mpi`: one rank per process of an MPI job (`mpirun -np N metashard serve
//! --dist mpi --devices cpu:1xT ...`). The ranks agree on the model, split, precision, slots
//! and context (`cli::agree`), then each loads its share of the weights; rank 0 runs the HTTP
//! server and the request scheduler, and every other rank takes each of rank 0's batch steps
//! with it (`runtime::lockstep`: rank 0 sends a step's inputs before it computes, a heartbeat
//! while idle, and a stop when it stops serving). Only rank 0 listens. The other ranks ignore
//! SIGTERM (`mpirun` passes a signal it gets to every rank): rank 0 decides when the job
//! stops, and they end with its stop message.

use super::{ServeArgs, batch_session, leak, listen, serve_until_signal};
use crate::cli::run::{decoder_settings, load_dist};
use crate::cli::{agree, eprint_line, setting};
use metashard::cpu::Precision;
use metashard::dist::{Dist, launched_by_mpirun};
use metashard::runtime::lockstep::{Leader, Link, follow_server};
use metashard::{Error, Result};

pub(super) fn run(a: &ServeArgs) -> Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(Error::MpiNotCompiled);
    }
    if !launched_by_mpirun() {
        return Err(Error::invalid_argument(
            "--dist",
            "mpi",
            "serve --dist mpi runs as the ranks of an MPI job: start it with `mpirun -np N \
             metashard serve --dist mpi --devices cpu:1xT ...` (rank 0 serves, the others step \
             with it), or leave out --dist to serve from this process",
        ));
    }
    let e = &a.engine;
    let more = [setting("--parallel", e.parallel), setting("--ctx", e.ctx)];
    agree(
        Dist::Mpi,
        "serve",
        &e.model.name,
        decoder_settings(setting("--q8", e.q8), &e.split, more),
    )?;
    let precision = Precision::from_q8_flag(e.q8);
    let (set, mut m) = load_dist(
        &e.model.name,
        &e.devices,
        Dist::Mpi,
        precision,
        &e.split,
        false,
    )?;
    // Rank 0 reads the requests; the others only step.
    if let Some(c) = e.chat_template.as_ref().filter(|_| set.is_leader()) {
        m.choose_chat(c)?;
    }
    let m = leak(m);
    let link = Link::mpi()?;
    if set.is_leader() {
        let (listener, state, engine) = listen(a, &set, m, Some(Leader::new(link)?))?;
        return serve_until_signal(listener, state, engine, true);
    }
    // SAFETY: ignoring a signal touches no memory of ours.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    let mut batch = batch_session(e, &set, m)?;
    let rank = link.rank();
    eprint_line(format!("rank {rank}: taking rank 0's batch steps"));
    let done = follow_server(&link, |lens, seqs| {
        batch.set_lens(lens)?;
        batch.step(seqs).map(drop)
    })?;
    eprint_line(format!(
        "rank {rank}: rank 0 stopped serving after {} steps",
        done.steps
    ));
    Ok(())
}

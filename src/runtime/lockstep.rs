//! Batch steps taken in lockstep by the ranks of a job (`serve --dist mpi`): rank 0 runs the
//! request scheduler over its [`BatchSession`](crate::models::batch::BatchSession) and, before
//! each step computes, broadcasts the step's inputs ([`Msg::Step`]: every slot's length, and
//! each sequence's slot, tokens and whether it wants logits) through the session's step hook
//! ([`Leader::hook`]); every other rank waits for them in [`follow`] and takes the same step on
//! its own session, so the collectives inside the step meet. Sampling stays on rank 0: the
//! tokens it samples reach the others as the next step's inputs, and slot frees and reuses as
//! the next step's lengths.
//!
//! Deadlines: a follower waits for rank 0's first message as long as ranks wait for rank 0's
//! request after loading ([`crate::dist::REQUEST_TIMEOUT`]); after that rank 0 sends a
//! [`Msg::Heartbeat`] every [`HEARTBEAT`] it stays idle, and a follower that hears nothing for
//! [`IDLE_DEADLINE`] fails naming rank 0 (a rank 0 that exits on the same host is seen at once
//! through its pid: `collectives::mpi`). A step's collectives have the meta device's own
//! deadlines. [`Msg::Stop`] ends every follower's loop normally: rank 0 sends it when it stops
//! serving, then every rank ends the job as usual (`dist::finalize`).
//!
//! A message is a broadcast of its length and then of its bytes from rank 0
//! (`dist::share_over`), little-endian `u32` words: the kind, then for a step the slot count,
//! each slot's length (`u32::MAX`: free), the sequence count, and per sequence its slot, 1 when
//! it wants logits, its token count and its tokens.

use crate::collectives::Communicator;
use crate::dist::{Dist, REQUEST_TIMEOUT, job_communicator, share_over};
use crate::models::batch::{SeqInput, StepHook};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// How often an idle rank 0 tells the followers it is still there.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// How long a follower waits for rank 0's next message once serving started.
pub const IDLE_DEADLINE: Duration = Duration::from_secs(30);

/// What rank 0 sends the other ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Take this step: every slot's length before it (`None`: free), then each sequence's
    /// slot, tokens and whether it wants logits (a [`SeqInput`]).
    Step {
        lens: Vec<Option<usize>>,
        seqs: Vec<(usize, Vec<u32>, bool)>,
    },
    /// Rank 0 is idle and alive.
    Heartbeat,
    /// Rank 0 stopped serving: end the loop.
    Stop,
}

const STEP: u32 = 1;
const HEARTBEAT_KIND: u32 = 2;
const STOP: u32 = 3;
const FREE: u32 = u32::MAX;

impl Msg {
    /// A step's message from a step hook's arguments.
    pub fn step(lens: &[Option<usize>], seqs: &[SeqInput]) -> Msg {
        Msg::Step {
            lens: lens.to_vec(),
            seqs: seqs
                .iter()
                .map(|s| (s.slot, s.tokens.to_vec(), s.logits))
                .collect(),
        }
    }

    /// The message's bytes (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut w: Vec<u32> = Vec::new();
        match self {
            Msg::Heartbeat => w.push(HEARTBEAT_KIND),
            Msg::Stop => w.push(STOP),
            Msg::Step { lens, seqs } => {
                w.push(STEP);
                w.push(lens.len() as u32);
                w.extend(lens.iter().map(|l| l.map_or(FREE, |l| l as u32)));
                w.push(seqs.len() as u32);
                for (slot, tokens, logits) in seqs {
                    w.extend([*slot as u32, u32::from(*logits), tokens.len() as u32]);
                    w.extend(tokens);
                }
            }
        }
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// A message from its bytes; an error naming what does not decode.
    pub fn decode(b: &[u8]) -> std::result::Result<Msg, String> {
        if !b.len().is_multiple_of(4) {
            return Err(format!("{} bytes are not whole words", b.len()));
        }
        let mut words = b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")));
        let mut next = |what: &str| words.next().ok_or(format!("it ends before the {what}"));
        let msg = match next("kind")? {
            HEARTBEAT_KIND => Msg::Heartbeat,
            STOP => Msg::Stop,
            STEP => {
                let n = next("slot count")? as usize;
                let mut lens = Vec::with_capacity(n.min(b.len()));
                for _ in 0..n {
                    let l = next("slot lengths")?;
                    lens.push((l != FREE).then_some(l as usize));
                }
                let n = next("sequence count")? as usize;
                let mut seqs = Vec::with_capacity(n.min(b.len()));
                for _ in 0..n {
                    let slot = next("sequence's slot")? as usize;
                    let logits = next("sequence's logits flag")? != 0;
                    let k = next("token count")? as usize;
                    let mut tokens = Vec::with_capacity(k.min(b.len()));
                    for _ in 0..k {
                        tokens.push(next("tokens")?);
                    }
                    seqs.push((slot, tokens, logits));
                }
                Msg::Step { lens, seqs }
            }
            k => return Err(format!("unknown kind {k}")),
        };
        match words.next() {
            Some(_) => Err("it has bytes after its end".into()),
            None => Ok(msg),
        }
    }
}

/// The ranks' channel: this process's rank and communicators over the job whose waits give
/// up after a given time.
pub struct Link {
    rank: usize,
    world: usize,
    comm: Box<dyn Fn(Duration) -> Result<Arc<dyn Communicator>> + Send + Sync>,
}

impl Link {
    /// The link of this process of an MPI job (`Dist::Mpi`; `Error::MpiNotCompiled` without
    /// the feature).
    pub fn mpi() -> Result<Link> {
        let (rank, comm) = job_communicator(Dist::Mpi, IDLE_DEADLINE)?;
        Ok(Link {
            rank,
            world: comm.world_size(),
            comm: Box::new(|t| job_communicator(Dist::Mpi, t).map(|(_, c)| c)),
        })
    }

    /// A link over `comm` as rank `rank`, whose waits give up after `comm`'s own timeout (an
    /// in-process communicator in tests).
    pub fn over(comm: Arc<dyn Communicator>, rank: usize) -> Link {
        Link {
            rank,
            world: comm.world_size(),
            comm: Box::new(move |_| Ok(comm.clone())),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Rank 0 sends `msg` to every rank.
    fn send(&self, msg: &Msg) -> Result<()> {
        share_over(self.comm.as_ref()(IDLE_DEADLINE)?.as_ref(), 0, msg.encode()).map(drop)
    }

    /// Rank 0's next message, waiting at most `timeout`.
    fn recv(&self, timeout: Duration) -> Result<Msg> {
        let bytes = share_over(self.comm.as_ref()(timeout)?.as_ref(), self.rank, Vec::new())?;
        Msg::decode(&bytes).map_err(|reason| Error::RankFailed {
            rank: 0,
            world: self.world,
            collective: "lockstep",
            reason: format!(
                "its step message did not decode ({reason}): a different metashard binary?"
            ),
        })
    }
}

/// Rank 0's side: the step hook that sends each step, heartbeats and the stop.
#[derive(Clone)]
pub struct Leader {
    link: Arc<Link>,
}

impl Leader {
    /// Rank 0's side of `link`; an error on another rank.
    pub fn new(link: Link) -> Result<Leader> {
        if link.rank != 0 {
            return Err(Error::invalid_argument(
                "rank",
                link.rank,
                "only rank 0 leads the steps",
            ));
        }
        Ok(Leader {
            link: Arc::new(link),
        })
    }

    /// A step hook for rank 0's batch session: each step's inputs go to every rank first.
    pub fn hook<'m>(&self) -> StepHook<'m> {
        let link = self.link.clone();
        Box::new(move |lens, seqs| link.send(&Msg::step(lens, seqs)))
    }

    /// Tell the followers that rank 0 is idle and alive (every [`HEARTBEAT`] while idle).
    pub fn heartbeat(&self) -> Result<()> {
        self.link.send(&Msg::Heartbeat)
    }

    /// End the followers' loops.
    pub fn stop(&self) -> Result<()> {
        self.link.send(&Msg::Stop)
    }
}

/// What a follower did until rank 0 stopped it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Followed {
    pub steps: u64,
    pub heartbeats: u64,
}

/// A rank other than 0: take rank 0's steps through `step(lens, seqs)` (make the session's
/// slot lengths `lens`, then step `seqs`) until rank 0 says stop. The first message may take
/// `first` (rank 0 loads the model and opens its server), each later one [`IDLE_DEADLINE`]; a
/// wait past its deadline, a step that fails or a message that does not decode is an error
/// (naming rank 0 when it is at fault).
pub fn follow(
    link: &Link,
    first: Duration,
    idle: Duration,
    mut step: impl FnMut(&[Option<usize>], &[SeqInput]) -> Result<()>,
) -> Result<Followed> {
    let mut done = Followed::default();
    let mut timeout = first;
    loop {
        match link.recv(timeout)? {
            Msg::Stop => return Ok(done),
            Msg::Heartbeat => done.heartbeats += 1,
            Msg::Step { lens, seqs } => {
                let inputs: Vec<SeqInput> = seqs
                    .iter()
                    .map(|(slot, tokens, logits)| SeqInput {
                        slot: *slot,
                        tokens,
                        logits: *logits,
                    })
                    .collect();
                step(&lens, &inputs)?;
                done.steps += 1;
            }
        }
        timeout = idle;
    }
}

/// [`follow`] with the deadlines of a server: [`REQUEST_TIMEOUT`] for the first message,
/// [`IDLE_DEADLINE`] after.
pub fn follow_server(
    link: &Link,
    step: impl FnMut(&[Option<usize>], &[SeqInput]) -> Result<()>,
) -> Result<Followed> {
    follow(link, REQUEST_TIMEOUT, IDLE_DEADLINE, step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::CpuCommunicator;
    use std::time::Instant;

    #[test]
    fn messages_round_trip_and_bad_bytes_are_named() {
        let step = Msg::Step {
            lens: vec![Some(3), None, Some(0)],
            seqs: vec![(0, vec![7], true), (2, vec![1, 2, 3], false)],
        };
        for m in [step, Msg::Heartbeat, Msg::Stop] {
            assert_eq!(Msg::decode(&m.encode()), Ok(m));
        }
        let bytes = Msg::Step {
            lens: vec![None],
            seqs: vec![(0, vec![5, 6], true)],
        }
        .encode();
        let cut = Msg::decode(&bytes[..bytes.len() - 4]).unwrap_err();
        assert!(cut.contains("before the tokens"), "{cut}");
        assert!(Msg::decode(&[9, 0, 0, 0]).unwrap_err().contains("kind 9"));
        assert!(Msg::decode(&[2, 0, 0]).unwrap_err().contains("whole words"));
        let mut long = Msg::Stop.encode();
        long.extend([0; 4]);
        assert!(Msg::decode(&long).unwrap_err().contains("after its end"));
    }

    #[test]
    fn followers_take_rank_0_s_steps_until_it_stops() {
        let comm: Arc<dyn Communicator> =
            Arc::new(CpuCommunicator::with_timeout(3, Duration::from_secs(20)).unwrap());
        let followers: Vec<_> = (1..3)
            .map(|r| {
                let comm = comm.clone();
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let done = follow(
                        &Link::over(comm, r),
                        Duration::from_secs(20),
                        Duration::from_secs(20),
                        |lens, seqs| {
                            let s: Vec<_> =
                                seqs.iter().map(|s| (s.slot, s.tokens.to_vec())).collect();
                            seen.push((lens.to_vec(), s));
                            Ok(())
                        },
                    )
                    .unwrap();
                    (done, seen)
                })
            })
            .collect();
        let leader = Leader::new(Link::over(comm, 0)).unwrap();
        let mut hook = leader.hook();
        let seq = [SeqInput {
            slot: 1,
            tokens: &[4, 5],
            logits: true,
        }];
        hook(&[None, Some(2)], &seq).unwrap();
        leader.heartbeat().unwrap();
        hook(&[Some(0), Some(4)], &seq).unwrap();
        leader.stop().unwrap();
        for f in followers {
            let (done, seen) = f.join().unwrap();
            assert_eq!(
                done,
                Followed {
                    steps: 2,
                    heartbeats: 1
                }
            );
            assert_eq!(seen[0], (vec![None, Some(2)], vec![(1, vec![4, 5])]));
            assert_eq!(seen[1].0, vec![Some(0), Some(4)]);
        }
    }

    #[test]
    fn a_follower_whose_leader_is_silent_fails_naming_it_within_the_deadline() {
        let comm: Arc<dyn Communicator> =
            Arc::new(CpuCommunicator::with_timeout(2, Duration::from_millis(300)).unwrap());
        let t = Instant::now();
        let e = follow(
            &Link::over(comm, 1),
            Duration::ZERO,
            Duration::ZERO,
            |_, _| Ok(()),
        )
        .unwrap_err()
        .to_string();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(e.contains("rank(s) [0]"), "{e}");
        assert!(Leader::new(Link::over(Arc::new(CpuCommunicator::new(2).unwrap()), 1)).is_err());
    }
}

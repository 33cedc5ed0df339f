//! `serve --dist mpi` (part of `tests/mpi.rs`, with its helpers): SmolLM2 served from rank 0
//! of `mpirun -np 2`, the other rank taking each batch step with it. Eight concurrent
//! completions and chats on four slots each get the text `metashard run` gives for the prompt on the same split in one
//! process (`cpu:2x1`), a request after an idle pause (heartbeats) too; SIGTERM to rank 0 ends
//! every rank with status 0. Outside `mpirun`, `serve --dist mpi` says how to start it.

use super::with_mpi::{mpirun_missing, rank_pid, text};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_metashard");
const N: usize = 12;
/// `serve` with one rank per process.
const SERVE: &[&str] = &[
    "serve",
    "--model",
    "smollm2",
    "--dist",
    "mpi",
    "--devices",
    "cpu:1x1",
];
const CASES: [(&str, bool); 4] = [
    ("The capital of France is", false),
    ("The capital of France is", true),
    ("Write a haiku about the sea.", false),
    ("Write a haiku about the sea.", true),
];

/// The text `metashard run` gives for `prompt` on `cpu:2x1` (greedy, -n N), raw or through
/// the chat template.
fn run_text(prompt: &str, chat: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "run",
        "--model",
        "smollm2",
        "--devices",
        "cpu:2x1",
        "--json",
    ])
    .args(["-n", &N.to_string(), "--prompt", prompt]);
    if !chat {
        cmd.arg("--raw");
    }
    let out = cmd.output().expect("metashard runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("run --json prints JSON");
    v["text"].as_str().expect("text").to_string()
}

/// An HTTP/1.0 exchange with the server: the status and the body.
fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = String::new();
    s.read_to_string(&mut r)?;
    let (head, body) = r.split_once("\r\n\r\n").unwrap_or((&r, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

/// The text the server generates for `prompt` (greedy, `max_tokens` N), completed or chatted.
fn served_text(port: u16, prompt: &str, chat: bool) -> String {
    let (path, mut body) = if chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        ("/v1/completions", json!({"prompt": prompt}))
    };
    body["max_tokens"] = json!(N);
    body["temperature"] = json!(0);
    let (status, reply) = http(port, "POST", path, &body.to_string()).expect("the server answers");
    assert_eq!(status, 200, "{reply}");
    let v: Value = serde_json::from_str(&reply).expect("a JSON reply");
    let c = &v["choices"][0];
    let t = if chat {
        &c["message"]["content"]
    } else {
        &c["text"]
    };
    t.as_str().expect("a text").to_string()
}

#[test]
fn serve_on_two_ranks_gives_run_s_text_and_sigterm_ends_every_rank() {
    if mpirun_missing() {
        return;
    }
    let want: Vec<String> = CASES.iter().map(|&(p, chat)| run_text(p, chat)).collect();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "-np", "2"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .arg(BIN)
        .args(SERVE)
        .args([
            "--parallel",
            "4",
            "--ctx",
            "256",
            "--port",
            &port.to_string(),
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let lines: Vec<String> = BufReader::new(stderr)
            .lines()
            .map_while(|l| l.ok())
            .collect();
        lines.join("\n")
    });
    let t = Instant::now();
    while !http(port, "GET", "/health", "").is_ok_and(|(s, _)| s == 200) {
        if t.elapsed() > Duration::from_secs(90) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the server did not start:\n{}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Eight requests at once on four slots: batches across both ranks, slots freed and
    // taken again while others run.
    let got: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = CASES
            .iter()
            .chain(&CASES)
            .map(|&(p, chat)| s.spawn(move || served_text(port, p, chat)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a client"))
            .collect()
    });
    // Idle past a heartbeat, then one more.
    std::thread::sleep(Duration::from_millis(2500));
    let again = served_text(port, CASES[3].0, CASES[3].1);
    let pid = rank_pid(child.id(), 0).expect("rank 0 is a child of mpirun");
    // SAFETY: sending a signal to a process this test started; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "SIGTERM to rank 0 did not end the job:\n{}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let e = reader.join().unwrap();
    for (i, g) in got.iter().enumerate() {
        let (p, chat) = CASES[i % CASES.len()];
        assert_eq!(g, &want[i % CASES.len()], "{p:?} chat={chat}\n{e}");
    }
    assert_eq!(&again, &want[3], "after the idle pause\n{e}");
    assert!(status.success(), "the job ended with {status}\n{e}");
    // Rank 1 took rank 0's steps and ended with its stop.
    let steps: u64 = e
        .lines()
        .find_map(|l| {
            l.strip_prefix("rank 1: rank 0 stopped serving after ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("rank 1 did not say it stopped\n{e}"));
    assert!(steps >= N as u64, "{steps} steps\n{e}");
}

#[test]
fn serve_dist_mpi_outside_mpirun_says_how_to_start_it() {
    let out = Command::new(BIN)
        .args(SERVE)
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMIX_RANK")
        .env_remove("PMI_RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .expect("metashard runs");
    let e = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("--dist mpi") && e.contains("mpirun -np N metashard serve"),
        "{e}"
    );
}

//! `metashard serve` against the official `openai` Python client
//! (`scripts/serve_openai_test.py`): completions and chat completions, whole and streamed, 8
//! clients at once on 4 slots, each text equal to what `metashard run` gives for the prompt
//! (greedy); clients closing their streams early free their slots (`/metrics`); the 4xx cases (max_tokens 0, a bad temperature, a prompt past the context,
//! malformed JSON, a wrong type, a missing or wrong API key) get their status and an
//! OpenAI-style message; SIGTERM ends the server with status 0.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_metashard");
const N: usize = 12;

fn models() -> String {
    std::env::var("METASHARD_MODELS").unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models-cache")
            .to_string_lossy()
            .into_owned()
    })
}

/// The text `metashard run` generates for `prompt` (greedy, -n N), raw or through the chat
/// template.
fn run_text(prompt: &str, chat: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.env("METASHARD_MODELS", models())
        .args(["run", "--model", "smollm2", "--devices", "cpu", "--json"])
        .args(["-n", &N.to_string(), "--prompt", prompt]);
    if !chat {
        cmd.arg("--raw");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

fn healthy(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.write_all(b"GET /health HTTP/1.0\r\n\r\n");
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200")
}

#[test]
fn the_openai_client_gets_what_run_gives_and_the_errors_it_should() {
    if Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: no `openai` package, test skipped");
            return;
        }
        panic!("install the `openai` package: python3 -m pip install -r scripts/requirements.txt");
    }
    let prompts = ["The capital of France is", "Write a haiku about the sea."];
    let mut cases = Vec::new();
    for p in prompts {
        for chat in [false, true] {
            cases.push(serde_json::json!({"prompt": p, "chat": chat, "text": run_text(p, chat)}));
        }
    }
    let dir = std::env::temp_dir().join(format!("metashard-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let expect = dir.join("expect.json");
    std::fs::write(&expect, serde_json::to_vec(&cases).unwrap()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = Command::new(BIN)
        .env("METASHARD_MODELS", models())
        .args(["serve", "--model", "smollm2", "--devices", "cpu"])
        .args(["--parallel", "4", "--ctx", "256", "--api-key", "test-key"])
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !healthy(port) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the server did not start"
        );
        assert!(server.try_wait().unwrap().is_none(), "the server exited");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = Command::new("python3")
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/serve_openai_test.py"))
        .args(["--base-url", &format!("http://127.0.0.1:{port}/v1")])
        .args(["--api-key", "test-key", "--max-tokens", &N.to_string()])
        .arg("--expect")
        .arg(&expect)
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    let term = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "SIGTERM did not end the server"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "the server ended with {status}");
}

//! `metashard serve`: an OpenAI-compatible HTTP server (axum on tokio) over the request
//! scheduler (`models::engine`): `POST /v1/completions` and `/v1/chat/completions` (the model's
//! chat template), whole or streamed as server-sent events (`api.rs`), `GET /v1/models`,
//! `GET /health`, `GET /metrics` (Prometheus text: `metrics.rs`).
//! The engine runs on its own thread and steps while requests are running; each HTTP request
//! submits a generation and receives its events over a channel; a client that goes away
//! (its channel closed) cancels its request and frees its slot. At most `--max-queue` requests
//! wait for a slot; more are answered 429 with `Retry-After`. Errors are OpenAI-style JSON
//! with a 4xx status; `--api-key` is checked in constant time. [`start`] runs a server on its
//! own threads (what `bench serve` measures); [`run`] serves until SIGTERM or Ctrl-C. With
//! `--dist mpi` rank 0 serves and the other ranks take its batch steps (`ranks.rs`).

mod api;
mod metrics;
mod ranks;

use super::run::load;
use super::{ModelArgs, SplitArgs, parse_positive};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::dist::Dist;
use metashard::models::batch::BatchSession;
use metashard::models::engine::{Engine, Event, GenRequest, RequestId};
use metashard::models::loader::DecoderModel;
use metashard::runtime::lockstep::{HEARTBEAT, Leader};
use metashard::{Error, Result};
use metrics::{Gauges, Memory};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Instant;
use tokio::sync::mpsc;

/// The model and engine flags of `serve`, which `bench serve` takes for the server it starts.
#[derive(Clone, Debug, clap::Args)]
pub struct EngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Devices: `cpu`, `cpu:N`, `cpu:NxT`.
    #[arg(long, default_value = "cpu")]
    pub devices: String,
    #[command(flatten)]
    pub split: SplitArgs,
    /// Sequences decoded together (KV cache slots).
    #[arg(long, default_value_t = 4, value_parser = parse_positive)]
    pub parallel: usize,
    /// Context of each slot in tokens (prompt and generated), within the model's.
    #[arg(long, default_value_t = 2048, value_parser = parse_positive)]
    pub ctx: usize,
    /// Tokens evaluated per step at most (decode tokens first, then prompt chunks).
    #[arg(long, default_value_t = 256, value_parser = parse_positive)]
    pub batch_tokens: usize,
    /// Requests waiting for a slot at most; a request past them is answered 429 with
    /// `Retry-After`.
    #[arg(long, default_value_t = 64, value_parser = parse_max_queue)]
    pub max_queue: usize,
    /// Quantized weights times 8-bit activations.
    #[arg(long)]
    pub q8: bool,
    /// The chat format: `llama3`, `gemma`, `phi3`, `chatml` (metashard's own, for an
    /// instruction model whose file has no `tokenizer.chat_template` or a wrong one; the
    /// model's vocabulary must have the format's turn tokens), or a file holding a Jinja
    /// template. Default: the file's template; none (a base model's file): the raw prompt.
    #[arg(long, value_name = "NAME|FILE")]
    pub chat_template: Option<String>,
}

#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// With `--dist mpi` (under `mpirun`), rank 0 serves and every other rank takes each of
    /// its batch steps with it.
    #[command(flatten)]
    pub dist: super::DistArgs,
}

/// Most requests `--max-queue` lets wait.
const MAX_QUEUE: usize = 1 << 20;

fn parse_max_queue(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_QUEUE => Ok(n),
        _ => Err(format!(
            "expected a whole number in 0..={MAX_QUEUE}, got `{s}`"
        )),
    }
}

/// What the HTTP side asks the engine thread.
enum Cmd {
    Submit {
        req: GenRequest,
        events: mpsc::UnboundedSender<Msg>,
        accepted: tokio::sync::oneshot::Sender<std::result::Result<RequestId, Refused>>,
        /// When the request arrived (its wait for a slot counts from there).
        since: Instant,
    },
}

/// Why the engine thread did not take a request.
enum Refused {
    /// The engine's check failed (400).
    Invalid(String),
    /// `waiting` requests wait already, `--max-queue` of them (429).
    Full { waiting: usize },
}

/// What a request receives.
enum Msg {
    Event(Event),
    Failed(String),
}

/// Shared by the handlers.
struct AppState {
    /// The model, for its name, tokenizer and chat template (the engine thread runs it).
    model: &'static DecoderModel,
    cmds: std_mpsc::Sender<Cmd>,
    api_key: Option<String>,
    ctx: usize,
    slots: usize,
    max_queue: usize,
    /// The engine's counters, as of its last step.
    gauges: Arc<parking_lot::Mutex<Gauges>>,
    /// Bytes each device holds.
    memory: Memory,
}

/// A server running on its own threads (from [`start`]).
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    /// Stop listening, let the open requests finish, and wait for the HTTP thread.
    pub fn stop(mut self) -> Result<()> {
        self.shut()
    }

    fn shut(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.http.take().map(|h| h.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::invalid_argument("serve", "HTTP thread", "panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.shut();
    }
}

pub fn run(a: &ServeArgs) -> Result<()> {
    if a.dist.dist == Dist::Mpi {
        return ranks::run(a);
    }
    let (listener, state, engine) = open(a, false)?;
    serve_until_signal(listener, state, engine, false)
}

/// Serve until SIGTERM or Ctrl-C. With `join` (rank 0 of a job) also until the engine thread
/// ends (a failed step: the other ranks failed too), then wait for it: the error that ended it,
/// or its stop message sent to the other ranks.
fn serve_until_signal(
    listener: std::net::TcpListener,
    state: AppState,
    engine: EngineThread,
    join: bool,
) -> Result<()> {
    super::eprint_line(format!("listening on http://{}", local_addr(&listener)?));
    let (ended, mut ended_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = std::thread::spawn(move || {
        let r = engine.run();
        let _ = ended.send(());
        r
    });
    let stop = async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = &mut ended_rx, if join => {}
        }
    };
    runtime()?.block_on(serve(listener, state, stop))?;
    if !join {
        return Ok(());
    }
    handle
        .join()
        .map_err(|_| Error::invalid_argument("serve", "engine thread", "panicked"))?
}

/// Load the model, open the engine and listen, as `a` says, on threads of its own; `quiet`
/// hides the loading progress.
pub fn start(a: &ServeArgs, quiet: bool) -> Result<Server> {
    let (listener, state, engine) = open(a, quiet)?;
    let addr = local_addr(&listener)?;
    std::thread::spawn(move || engine.run());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let http = std::thread::spawn(move || {
        runtime()?.block_on(serve(listener, state, async {
            let _ = rx.await;
        }))
    });
    Ok(Server {
        addr,
        stop: Some(tx),
        http: Some(http),
    })
}

fn local_addr(l: &std::net::TcpListener) -> Result<SocketAddr> {
    l.local_addr()
        .map_err(|e| Error::invalid_argument("--host/--port", "listener", e.to_string()))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::invalid_argument("serve", "runtime", e.to_string()))
}

/// The engine thread's half: the engine, the commands it takes and what it publishes.
struct EngineThread {
    engine: Engine<'static>,
    cmds: std_mpsc::Receiver<Cmd>,
    gauges: Arc<parking_lot::Mutex<Gauges>>,
    max_queue: usize,
    /// Rank 0 of a job: each step goes to the other ranks first (the batch's step hook); idle,
    /// a heartbeat every [`HEARTBEAT`]; at the end, the stop.
    leader: Option<Leader>,
}

/// The model loaded, the engine made and the address bound (the port taken, so a caller
/// learns it before serving).
fn open(s: &ServeArgs, quiet: bool) -> Result<(std::net::TcpListener, AppState, EngineThread)> {
    let a = &s.engine;
    a.split.check(&a.devices)?;
    let (set, mut m) = load(
        &a.model.name,
        &a.devices,
        Precision::from_q8_flag(a.q8),
        &a.split,
        quiet,
    )?;
    if let Some(c) = &a.chat_template {
        m.choose_chat(c)?;
    }
    listen(s, &set, leak(m), None)
}

/// The model, living as long as the server process: the handlers and the engine thread share
/// it.
fn leak(m: DecoderModel) -> &'static DecoderModel {
    Box::leak(Box::new(m))
}

/// The batch session `a` asks for, of `m` on `set`.
fn batch_session(
    a: &EngineArgs,
    set: &DeviceSet,
    m: &'static DecoderModel,
) -> Result<BatchSession<'static>> {
    BatchSession::new(
        m,
        set.backend.clone(),
        set.buffer_type.as_ref(),
        a.parallel,
        a.ctx,
    )
}

/// The engine made over `m` on `set` and the address bound; `leader`: this is rank 0 of a job
/// whose other ranks take its steps.
fn listen(
    s: &ServeArgs,
    set: &DeviceSet,
    m: &'static DecoderModel,
    leader: Option<Leader>,
) -> Result<(std::net::TcpListener, AppState, EngineThread)> {
    let a = &s.engine;
    let mut batch = batch_session(a, set, m)?;
    if let Some(l) = &leader {
        batch.set_step_hook(Some(l.hook()));
    }
    let memory = Memory {
        devices: set.names(),
        weights: set.bytes_per_device(&[&m.weight_buffer]),
        kv_cache: set.bytes_per_device(&[&batch.cache_buffer()]),
    };
    let ctx = batch.ctx();
    let engine = Engine::new(batch, a.batch_tokens);
    let (tx, rx) = std_mpsc::channel();
    let gauges = Arc::new(parking_lot::Mutex::new(Gauges::default()));
    let state = AppState {
        model: m,
        cmds: tx,
        api_key: s.api_key.clone(),
        ctx,
        slots: a.parallel,
        max_queue: a.max_queue,
        gauges: gauges.clone(),
        memory,
    };
    let addr = format!("{}:{}", s.host, s.port);
    let listener = std::net::TcpListener::bind(&addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| Error::invalid_argument("--host/--port", &addr, e.to_string()))?;
    let engine = EngineThread {
        engine,
        cmds: rx,
        gauges,
        max_queue: a.max_queue,
        leader,
    };
    Ok((listener, state, engine))
}

async fn serve(
    listener: std::net::TcpListener,
    state: AppState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let addr = local_addr(&listener)?;
    let app = Router::new()
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/completions", post(api::completions))
        .route("/v1/chat/completions", post(api::chat_completions))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(Arc::new(state));
    let listener = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| Error::invalid_argument("--host/--port", addr, e.to_string()))?;
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
        .map_err(|e| Error::invalid_argument("serve", addr, e.to_string()))
}

impl EngineThread {
    /// Waits for a request when idle, else takes every command then steps; each event goes
    /// to its request's channel, and a request whose channel is closed (the client went away)
    /// is cancelled. Ends when the server drops its sender (a leader then tells the other
    /// ranks to stop), or with the error of a failed step (or heartbeat).
    fn run(mut self) -> Result<()> {
        let r = self.serve_commands();
        match (&r, &self.leader) {
            (Ok(()), Some(l)) => l.stop(),
            _ => r,
        }
    }

    /// The next command when idle (`Ok(None)`: the server dropped its sender); a leader
    /// sends a heartbeat every [`HEARTBEAT`] while it waits.
    fn wait(&self) -> Result<Option<Cmd>> {
        let Some(leader) = &self.leader else {
            return Ok(self.cmds.recv().ok());
        };
        loop {
            match self.cmds.recv_timeout(HEARTBEAT) {
                Ok(c) => return Ok(Some(c)),
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return Ok(None),
                Err(std_mpsc::RecvTimeoutError::Timeout) => leader.heartbeat()?,
            }
        }
    }

    fn serve_commands(&mut self) -> Result<()> {
        let mut senders: std::collections::HashMap<RequestId, mpsc::UnboundedSender<Msg>> =
            std::collections::HashMap::new();
        loop {
            let first = if self.engine.is_idle() {
                match self.wait()? {
                    Some(c) => Some(c),
                    None => return Ok(()),
                }
            } else {
                None
            };
            let cmds: Vec<Cmd> = first.into_iter().chain(self.cmds.try_iter()).collect();
            for cmd in cmds {
                self.take(cmd, &mut senders);
            }
            let gone: Vec<RequestId> = senders
                .iter()
                .filter(|(_, s)| s.is_closed())
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                senders.remove(&id);
                let _ = self.engine.cancel(id);
            }
            let t0 = Instant::now();
            let stepped = self.engine.step();
            self.gauges
                .lock()
                .publish(&self.engine, t0.elapsed().as_secs_f64());
            match stepped {
                Ok(events) => {
                    for ev in events {
                        let id = match &ev {
                            Event::Token { id, .. } | Event::Finished { id, .. } => *id,
                        };
                        let done = matches!(ev, Event::Finished { .. });
                        if let Some(s) = senders.get(&id) {
                            let _ = s.send(Msg::Event(ev));
                        }
                        if done {
                            senders.remove(&id);
                        }
                    }
                }
                Err(err) => {
                    tracing::error!("engine step failed: {err}");
                    for (_, s) in senders.drain() {
                        let _ = s.send(Msg::Failed(err.to_string()));
                    }
                    return Err(err);
                }
            }
        }
    }

    /// Queue a submitted request, or refuse it: the engine's checks, or a full queue (the
    /// request would wait beyond the free slots and `max_queue` others).
    fn take(
        &mut self,
        cmd: Cmd,
        senders: &mut std::collections::HashMap<RequestId, mpsc::UnboundedSender<Msg>>,
    ) {
        let Cmd::Submit {
            req,
            events,
            accepted,
            since,
        } = cmd;
        let e = &mut self.engine;
        let would_wait = (e.queued() + 1).saturating_sub(e.batch().free_slots());
        if would_wait > self.max_queue {
            self.gauges.lock().rejected += 1;
            let _ = accepted.send(Err(Refused::Full {
                waiting: e.waiting(),
            }));
            return;
        }
        match e.submit_since(req, since) {
            Ok(id) => {
                senders.insert(id, events);
                let _ = accepted.send(Ok(id));
            }
            Err(err) => {
                let _ = accepted.send(Err(Refused::Invalid(err.to_string())));
            }
        }
    }
}

/// An OpenAI-style error response (a 429 with the type and code the OpenAI API gives a
/// client over its request limit: `requests`, `rate_limit_exceeded`).
fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let (kind, code) = match status {
        StatusCode::UNAUTHORIZED => ("authentication_error", None),
        StatusCode::TOO_MANY_REQUESTS => ("requests", Some("rate_limit_exceeded")),
        s if s.is_client_error() => ("invalid_request_error", None),
        _ => ("server_error", None),
    };
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}});
    (status, axum::Json(body)).into_response()
}

/// Equal bytes, in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | (a.len() != b.len()) as u8;
    for (i, &x) in a.iter().enumerate() {
        diff |= x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0);
    }
    diff == 0
}

fn authorized(state: &AppState, headers: &HeaderMap) -> std::result::Result<(), Response> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "a missing or wrong API key",
            None,
        ))
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&state, &headers) {
        return r;
    }
    axum::Json(json!({"object": "list", "data": [
        {"id": state.model.name, "object": "model", "created": 0, "owned_by": "metashard"}
    ]}))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn keys_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(!constant_time_eq(b"secret", b""));
    }
}

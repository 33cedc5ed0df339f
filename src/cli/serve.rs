//! `metashard serve`: an OpenAI-compatible HTTP server (axum on tokio) over the request
//! scheduler (`models::engine`): `POST /v1/completions` and `/v1/chat/completions` (the model's
//! chat template), whole or streamed as server-sent events, `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text).
//! The engine runs on its own thread and steps while requests are running; each HTTP request
//! submits a generation and receives its events over a channel; a client that goes away
//! (its channel closed) cancels its request and frees its slot. Errors are OpenAI-style JSON
//! with a 4xx status; `--api-key` is checked in constant time. Shapes follow the OpenAI API
//! reference (platform.openai.com/docs/api-reference/completions, .../chat).

use super::run::load;
use super::{ModelArgs, SplitArgs, parse_positive};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metashard::cpu::Precision;
use metashard::models::batch::BatchSession;
use metashard::models::engine::{Engine, Event, FinishReason, GenRequest, RequestId};
use metashard::models::loader::DecoderModel;
use metashard::models::sampler::SamplerConfig;
use metashard::tokenizer::ChatMessage;
use metashard::{Error, Result};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use tokio::sync::mpsc;

#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
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
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Quantized weights times 8-bit activations.
    #[arg(long)]
    pub q8: bool,
}

/// What the HTTP side asks the engine thread.
enum Cmd {
    Submit {
        req: GenRequest,
        events: mpsc::UnboundedSender<Msg>,
        accepted: tokio::sync::oneshot::Sender<std::result::Result<RequestId, String>>,
    },
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
    /// The engine's counters, as of its last step.
    gauges: Arc<parking_lot::Mutex<Gauges>>,
}

/// What `GET /metrics` reports, published by the engine thread.
#[derive(Clone, Copy, Debug, Default)]
struct Gauges {
    requests: u64,
    running: usize,
    queued: usize,
    slots: usize,
    steps: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    last_step_secs: f64,
}

/// Chat messages to prompt tokens: the model's chat template (the messages' text literal, so
/// control tokens come only from the template), or the contents one per line without one.
fn chat_tokens(m: &DecoderModel, msgs: &[ChatMessage]) -> Result<Vec<u32>> {
    match &m.chat {
        Some(t) => {
            let (text, user) = t.render_spans(msgs, true)?;
            m.tokenizer.encode_with_literals(&text, true, &user)
        }
        None => {
            let text: Vec<&str> = msgs.iter().map(|m| m.content.as_str()).collect();
            m.tokenizer.encode_with(&text.join("\n"), true, false)
        }
    }
}

pub fn run(a: &ServeArgs) -> Result<()> {
    a.split.check(&a.devices)?;
    let (set, m) = load(
        &a.model.name,
        &a.devices,
        Precision::from_q8_flag(a.q8),
        &a.split,
        false,
    )?;
    // The model lives as long as the server process: the handlers and the engine thread
    // share it.
    let m: &'static DecoderModel = Box::leak(Box::new(m));
    let batch = BatchSession::new(
        m,
        set.backend.clone(),
        set.buffer_type.as_ref(),
        a.parallel,
        a.ctx,
    )?;
    let ctx = batch.ctx();
    let engine = Engine::new(batch, a.batch_tokens);
    let (tx, rx) = std_mpsc::channel();
    let gauges = Arc::new(parking_lot::Mutex::new(Gauges {
        slots: a.parallel,
        ..Gauges::default()
    }));
    let state = Arc::new(AppState {
        model: m,
        cmds: tx,
        api_key: a.api_key.clone(),
        ctx,
        gauges: gauges.clone(),
    });
    let addr = format!("{}:{}", a.host, a.port);
    std::thread::scope(|s| {
        s.spawn(move || engine_loop(engine, rx, &gauges));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::invalid_argument("serve", "runtime", e.to_string()))?
            .block_on(serve(addr, state))
    })
}

async fn serve(addr: String, state: Arc<AppState>) -> Result<()> {
    let app = Router::new()
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| Error::invalid_argument("--host/--port", &addr, e.to_string()))?;
    super::eprint_line(format!("listening on http://{addr}"));
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
        .map_err(|e| Error::invalid_argument("serve", &addr, e.to_string()))
}

/// The engine thread: waits for a request when idle, else takes every command then steps;
/// each event goes to its request's channel, and a request whose channel is closed (the client
/// went away) is cancelled. Ends when the server drops its sender.
fn engine_loop(mut e: Engine, rx: std_mpsc::Receiver<Cmd>, gauges: &parking_lot::Mutex<Gauges>) {
    let mut senders: std::collections::HashMap<RequestId, mpsc::UnboundedSender<Msg>> =
        std::collections::HashMap::new();
    loop {
        let first = if e.is_idle() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        for cmd in first.into_iter().chain(rx.try_iter()) {
            let Cmd::Submit {
                req,
                events,
                accepted,
            } = cmd;
            match e.submit(req) {
                Ok(id) => {
                    senders.insert(id, events);
                    let _ = accepted.send(Ok(id));
                }
                Err(err) => {
                    let _ = accepted.send(Err(err.to_string()));
                }
            }
        }
        let gone: Vec<RequestId> = senders
            .iter()
            .filter(|(_, s)| s.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            senders.remove(&id);
            let _ = e.cancel(id);
        }
        let t0 = std::time::Instant::now();
        let stepped = e.step();
        {
            let mut g = gauges.lock();
            g.requests = e.stats.requests;
            g.running = e.running();
            g.queued = e.queued();
            g.steps = e.stats.steps;
            g.prompt_tokens = e.stats.prompt_tokens;
            g.generated_tokens = e.stats.generated_tokens;
            g.last_step_secs = t0.elapsed().as_secs_f64();
        }
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
                return;
            }
        }
    }
}

/// An OpenAI-style error response.
fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        s if s.is_client_error() => "invalid_request_error",
        _ => "server_error",
    };
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": param, "code": null}});
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

/// Prometheus text exposition format (prometheus.io/docs/instrumenting/exposition_formats).
async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&state, &headers) {
        return r;
    }
    let g = *state.gauges.lock();
    let rows: [(&str, &str, &str, f64); 8] = [
        (
            "requests_total",
            "counter",
            "requests accepted",
            g.requests as f64,
        ),
        (
            "requests_running",
            "gauge",
            "requests holding a slot",
            g.running as f64,
        ),
        (
            "requests_queued",
            "gauge",
            "requests waiting for a slot",
            g.queued as f64,
        ),
        ("slots", "gauge", "KV cache slots", g.slots as f64),
        (
            "steps_total",
            "counter",
            "batched steps run",
            g.steps as f64,
        ),
        (
            "prompt_tokens_total",
            "counter",
            "prompt tokens evaluated",
            g.prompt_tokens as f64,
        ),
        (
            "generated_tokens_total",
            "counter",
            "tokens generated",
            g.generated_tokens as f64,
        ),
        (
            "step_seconds",
            "gauge",
            "time of the last step",
            g.last_step_secs,
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, v) in rows {
        out.push_str(&format!(
            "# HELP metashard_{name} {help}\n# TYPE metashard_{name} {kind}\nmetashard_{name} {v}\n"
        ));
    }
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, false).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, true).await
}

/// A request's body as the generation it asks for, or a 400 response naming the field.
fn parse(
    state: &AppState,
    body: &[u8],
    chat: bool,
) -> std::result::Result<(GenRequest, bool), Response> {
    let bad = |msg: String, param: &str| error(StatusCode::BAD_REQUEST, msg, Some(param));
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("malformed JSON: {e}"), "body"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("the body must be a JSON object".into(), "body"))?;
    let num = |k: &str| -> std::result::Result<Option<f64>, Response> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(bad(format!("`{k}` must be a number"), k)),
        }
    };
    let prompt = if chat {
        let msgs = obj
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("`messages` must be an array of messages".into(), "messages"))?;
        let mut out = Vec::new();
        for m in msgs {
            let role = m.get("role").and_then(Value::as_str);
            let content = m.get("content").and_then(Value::as_str);
            match (role, content) {
                (Some(r), Some(c)) => out.push(ChatMessage::new(r, c)),
                _ => {
                    return Err(bad(
                        "each message needs a string `role` and `content`".into(),
                        "messages",
                    ));
                }
            }
        }
        chat_tokens(state.model, &out)
    } else {
        match obj.get("prompt") {
            Some(Value::String(p)) => state.model.tokenizer.encode_with(p, true, false),
            _ => return Err(bad("`prompt` must be a string".into(), "prompt")),
        }
    }
    .map_err(|e| bad(e.to_string(), if chat { "messages" } else { "prompt" }))?;
    if prompt.len() >= state.ctx {
        return Err(bad(
            format!(
                "the prompt has {} tokens: the context is {} tokens with a token to generate",
                prompt.len(),
                state.ctx
            ),
            if chat { "messages" } else { "prompt" },
        ));
    }
    if let Some(n) = num("n")?
        && n != 1.0
    {
        return Err(bad("only `n` 1 is supported".into(), "n"));
    }
    let max_tokens = match num(if obj.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    })? {
        None if chat => state.ctx,
        None => 16,
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= 1e9 => x as usize,
        Some(x) => {
            return Err(bad(
                format!("`max_tokens` must be a whole number in 1..=1e9, not {x}"),
                "max_tokens",
            ));
        }
    };
    let sampling = SamplerConfig {
        temperature: num("temperature")?.unwrap_or(1.0) as f32,
        top_k: match num("top_k")? {
            None => usize::MAX,
            Some(x) if x >= 1.0 && x.fract() == 0.0 => x.min(1e18) as usize,
            Some(x) => {
                return Err(bad(
                    format!("`top_k` must be a whole number >= 1, not {x}"),
                    "top_k",
                ));
            }
        },
        top_p: num("top_p")?.unwrap_or(1.0) as f32,
        seed: num("seed")?.map_or(0, |s| s as u64),
    };
    sampling
        .validate()
        .map_err(|e| bad(e.to_string(), "sampling"))?;
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && a.len() <= 4 => a
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect(),
        Some(_) => {
            return Err(bad(
                "`stop` must be a string or up to 4 strings".into(),
                "stop",
            ));
        }
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`stream` must be a boolean".into(), "stream")),
    };
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop,
        ignore_eos: false,
    };
    Ok((req, stream))
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

async fn handle(state: Arc<AppState>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    if let Err(r) = authorized(&state, &headers) {
        return r;
    }
    let (req, stream) = match parse(&state, &body, chat) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (atx, arx) = tokio::sync::oneshot::channel();
    let n_prompt = req.prompt.len();
    if state
        .cmds
        .send(Cmd::Submit {
            req,
            events: tx,
            accepted: atx,
        })
        .is_err()
    {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped", None);
    }
    let id = match arx.await {
        Ok(Ok(id)) => id,
        Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, e, None),
        Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped", None),
    };
    tracing::info!(
        "request {id}: {} prompt tokens, stream {stream}, chat {chat}",
        n_prompt
    );
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (obj, rid) = if chat {
        ("chat.completion", format!("chatcmpl-{id}"))
    } else {
        ("text_completion", format!("cmpl-{id}"))
    };
    let model = state.model.name.clone();
    let choice = move |text: &str, finish: Option<&str>, first: bool| -> Value {
        if chat && stream {
            let mut delta = json!({"content": text});
            if first {
                delta["role"] = json!("assistant");
            }
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        } else if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        }
    };
    if stream {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let head = json!({"id": rid, "object": object, "created": created, "model": model});
        // Stages: 0 events, 1 the closing `[DONE]`, 2 the end.
        let s = futures_util::stream::unfold((rx, 0u8, true), move |(mut rx, stage, first)| {
            let head = head.clone();
            let sse = |d: String| Ok::<_, std::convert::Infallible>(SseEvent::default().data(d));
            async move {
                match stage {
                    0 => {}
                    1 => return Some((sse("[DONE]".into()), (rx, 2, false))),
                    _ => return None,
                }
                let (data, stage) = match rx.recv().await {
                    Some(Msg::Event(Event::Token { text, .. })) => {
                        let mut v = head.clone();
                        v["choices"] = json!([choice(&text, None, first)]);
                        (v.to_string(), 0)
                    }
                    Some(Msg::Event(Event::Finished {
                        reason,
                        text,
                        prompt_tokens,
                        completion_tokens,
                        ..
                    })) => {
                        let mut v = head.clone();
                        v["choices"] = json!([choice(&text, Some(finish_name(reason)), first)]);
                        v["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                        (v.to_string(), 1)
                    }
                    Some(Msg::Failed(e)) => (
                        json!({"error": {"message": e, "type": "server_error"}}).to_string(),
                        2,
                    ),
                    None => return None,
                };
                Some((sse(data), (rx, stage, false)))
            }
        });
        return Sse::new(s).into_response();
    }
    let mut text = String::new();
    while let Some(m) = rx.recv().await {
        match m {
            Msg::Event(Event::Token { text: t, .. }) => text.push_str(&t),
            Msg::Event(Event::Finished {
                reason,
                text: t,
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                text.push_str(&t);
                let body = json!({
                    "id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice(&text, Some(finish_name(reason)), true)],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens},
                });
                return axum::Json(body).into_response();
            }
            Msg::Failed(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e, None),
        }
    }
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine stopped",
        None,
    )
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

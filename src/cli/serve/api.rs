//! The generation endpoints of `metashard serve`: a body checked field by field into a
//! [`GenRequest`] (400 naming the field), submitted to the engine thread (429 with
//! `Retry-After` when its queue is full), answered whole or streamed as server-sent events.
//! Shapes follow the OpenAI API reference (platform.openai.com/docs/api-reference/completions,
//! .../chat).

use super::{AppState, Cmd, Msg, Refused, authorized, error};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use metashard::Result;
use metashard::models::engine::{Event, FinishReason, GenRequest, RequestId};
use metashard::models::loader::DecoderModel;
use metashard::models::sampler::SamplerConfig;
use metashard::tokenizer::ChatMessage;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::sync::mpsc;

pub(super) async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, false).await
}

pub(super) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, true).await
}

/// Chat messages to prompt tokens: the model's chat template (the messages' text literal, so
/// control tokens come only from the template), or the contents one per line without one
/// (a base model's file; `--chat-template` gives one).
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
        if msgs.is_empty() {
            return Err(bad(
                "`messages` must hold at least one message".into(),
                "messages",
            ));
        }
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
    // `ignore_eos`: llama.cpp's server's extension (tools/server/README.md), which `bench
    // serve` sends so that every request generates `max_tokens` tokens on either server.
    let ignore_eos = match obj.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`ignore_eos` must be a boolean".into(), "ignore_eos")),
    };
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop,
        ignore_eos,
    };
    Ok((req, stream))
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// Submit `req` to the engine thread: its id and the channel of its events, or the response
/// that refuses it (429 with `Retry-After` when the queue is full: RFC 6585 section 4, and
/// what the OpenAI API answers a client over its limits, which the `openai` clients retry
/// after the time the header says).
async fn submit(
    state: &AppState,
    req: GenRequest,
) -> std::result::Result<(RequestId, mpsc::UnboundedReceiver<Msg>), Response> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (atx, arx) = tokio::sync::oneshot::channel();
    let stopped = || error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped", None);
    let cmd = Cmd::Submit {
        req,
        events: tx,
        accepted: atx,
        since: std::time::Instant::now(),
    };
    if state.cmds.send(cmd).is_err() {
        return Err(stopped());
    }
    match arx.await {
        Ok(Ok(id)) => Ok((id, rx)),
        Ok(Err(Refused::Invalid(e))) => Err(error(StatusCode::BAD_REQUEST, e, None)),
        Ok(Err(Refused::Full { waiting })) => {
            let msg = format!(
                "the server is busy: {waiting} requests already wait for one of its {} slots \
                 (--max-queue {}); retry later",
                state.slots, state.max_queue
            );
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, msg, None);
            r.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
            Err(r)
        }
        Err(_) => Err(stopped()),
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
    let n_prompt = req.prompt.len();
    let (id, rx) = match submit(&state, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    tracing::info!("request {id}: {n_prompt} prompt tokens, stream {stream}, chat {chat}");
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let reply = Reply {
        chat,
        stream,
        id: if chat {
            format!("chatcmpl-{id}")
        } else {
            format!("cmpl-{id}")
        },
        created,
        model: state.model.name.clone(),
    };
    if stream {
        streamed(reply, rx)
    } else {
        whole(reply, rx).await
    }
}

/// What every response to one request repeats.
#[derive(Clone)]
struct Reply {
    chat: bool,
    stream: bool,
    id: String,
    created: u64,
    model: String,
}

impl Reply {
    /// The response object (or a streamed chunk) without its choices.
    fn head(&self) -> Value {
        let object = match (self.chat, self.stream) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model})
    }

    /// The one choice of a response or chunk.
    fn choice(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        if self.chat && self.stream {
            let mut delta = json!({"content": text});
            if first {
                delta["role"] = json!("assistant");
            }
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        } else if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        }
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens})
}

/// The events as server-sent events: a chunk per token, the last with the finish reason and
/// the usage, then `[DONE]`.
fn streamed(reply: Reply, rx: mpsc::UnboundedReceiver<Msg>) -> Response {
    // Stages: 0 events, 1 the closing `[DONE]`, 2 the end.
    let s = futures_util::stream::unfold((rx, 0u8, true), move |(mut rx, stage, first)| {
        let reply = reply.clone();
        let sse = |d: String| Ok::<_, std::convert::Infallible>(SseEvent::default().data(d));
        async move {
            match stage {
                0 => {}
                1 => return Some((sse("[DONE]".into()), (rx, 2, false))),
                _ => return None,
            }
            let mut v = reply.head();
            let stage = match rx.recv().await {
                Some(Msg::Event(Event::Token { text, .. })) => {
                    v["choices"] = json!([reply.choice(&text, None, first)]);
                    0
                }
                Some(Msg::Event(Event::Finished {
                    reason,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    ..
                })) => {
                    let finish = Some(finish_name(reason));
                    v["choices"] = json!([reply.choice(&text, finish, first)]);
                    v["usage"] = usage(prompt_tokens, completion_tokens);
                    1
                }
                Some(Msg::Failed(e)) => {
                    v = json!({"error": {"message": e, "type": "server_error"}});
                    2
                }
                None => return None,
            };
            Some((sse(v.to_string()), (rx, stage, false)))
        }
    });
    Sse::new(s).into_response()
}

/// The events gathered into one response.
async fn whole(reply: Reply, mut rx: mpsc::UnboundedReceiver<Msg>) -> Response {
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
                let mut body = reply.head();
                body["choices"] = json!([reply.choice(&text, Some(finish_name(reason)), true)]);
                body["usage"] = usage(prompt_tokens, completion_tokens);
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

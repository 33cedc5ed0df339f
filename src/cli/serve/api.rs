//! The generation endpoints of `metashard serve`: a body checked field by field into a
//! [`GenRequest`] (400 naming the field), submitted to the engine thread (429 with
//! `Retry-After` when its queue is full), answered whole or streamed as server-sent events,
//! with each generated token's log-probabilities when asked (`logprobs`: [`LogprobsOut`]).
//! Shapes follow the OpenAI API reference (platform.openai.com/docs/api-reference/completions,
//! .../chat).

use super::{AppState, Cmd, Msg, Refused, authorized, error};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use metashard::Result;
use metashard::models::engine::{
    Event, FinishReason, GenRequest, MAX_TOP_LOGPROBS, RequestId, TokenLogprob,
};
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
) -> std::result::Result<(GenRequest, bool, usize), Response> {
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
    // The completions API's token offsets count from the prompt's start.
    let mut prompt_chars = 0;
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
            match (role, m.get("content").map(message_text)) {
                (Some(r), Some(Ok(c))) => out.push(ChatMessage::new(r, c)),
                (_, Some(Err(e))) => return Err(bad(e, "messages")),
                _ => {
                    return Err(bad(
                        "each message needs a string `role` and a `content` (a string or an \
                         array of text parts)"
                            .into(),
                        "messages",
                    ));
                }
            }
        }
        chat_tokens(state.model, &out)
    } else {
        match obj.get("prompt") {
            Some(Value::String(p)) => {
                prompt_chars = p.chars().count();
                state.model.tokenizer.encode_with(p, true, false)
            }
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
        presence_penalty: num("presence_penalty")?.unwrap_or(0.0) as f32,
        frequency_penalty: num("frequency_penalty")?.unwrap_or(0.0) as f32,
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
    refuse_unsupported(obj, chat)?;
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop,
        ignore_eos,
        logprobs: parse_logprobs(obj, chat, num)?,
        logit_bias: parse_logit_bias(obj)?,
    };
    Ok((req, stream, prompt_chars))
}

/// A message's `content`: a string, or an array of content parts of which only text parts
/// (`{"type": "text", "text": ...}`, the OpenAI API's form) are taken, joined without a
/// separator; any other part (an image, audio, a file) is an error naming its type.
fn message_text(content: &Value) -> std::result::Result<String, String> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => return Err("a message's `content` must be a string or an array of parts".into()),
    };
    let mut text = String::new();
    for p in parts {
        match (
            p.get("type").and_then(Value::as_str),
            p.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(t)) => text.push_str(t),
            (Some(kind), _) if kind != "text" => {
                return Err(format!(
                    "content parts of type {kind:?} are not supported: metashard takes text"
                ));
            }
            _ => return Err("a text content part needs a string `text`".into()),
        }
    }
    Ok(text)
}

/// `logit_bias`: an object of token ids (as strings) to numbers; the engine checks the ids
/// against the vocabulary and the values' range.
fn parse_logit_bias(
    obj: &serde_json::Map<String, Value>,
) -> std::result::Result<Vec<(u32, f32)>, Response> {
    let bad = |msg: String| error(StatusCode::BAD_REQUEST, msg, Some("logit_bias"));
    let map = match obj.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("`logit_bias` must be an object".into())),
    };
    map.iter()
        .map(|(k, v)| {
            let t = k
                .parse::<u32>()
                .map_err(|_| bad(format!("`logit_bias` key {k:?} is not a token id")))?;
            let b = v
                .as_f64()
                .ok_or_else(|| bad(format!("`logit_bias` of token {t} must be a number")))?;
            Ok((t, b as f32))
        })
        .collect()
}

/// A 400 naming the first parameter of the OpenAI API whose value asks for what the server
/// does not do (rather than answering as if it were not there): `echo`, `suffix` and
/// `best_of` > 1 (completions), tools and functions, a `response_format` other than text.
fn refuse_unsupported(
    obj: &serde_json::Map<String, Value>,
    chat: bool,
) -> std::result::Result<(), Response> {
    // A parameter given with a value (null is absent); `asks` whether that value asks for it.
    let given =
        |k: &str, asks: fn(&Value) -> bool| obj.get(k).is_some_and(|v| !v.is_null() && asks(v));
    let any = |v: &Value| v.as_array().is_none_or(|a| !a.is_empty());
    let refused: &[(&str, bool, &str)] = &[
        (
            "echo",
            given("echo", |v| v != &Value::Bool(false)),
            "echoing the prompt",
        ),
        (
            "suffix",
            !chat && given("suffix", |v| v.as_str() != Some("")),
            "a suffix",
        ),
        (
            "best_of",
            given("best_of", |v| v.as_f64() != Some(1.0)),
            "`best_of` other than 1",
        ),
        ("tools", given("tools", any), "tool calls"),
        ("functions", given("functions", any), "function calls"),
        (
            "response_format",
            given("response_format", |v| {
                v.get("type").and_then(Value::as_str) != Some("text")
            }),
            "a `response_format` other than text (no constrained decoding)",
        ),
    ];
    match refused.iter().find(|r| r.1) {
        Some((k, _, what)) => Err(error(
            StatusCode::BAD_REQUEST,
            format!("`{k}`: metashard does not support {what}"),
            Some(k),
        )),
        None => Ok(()),
    }
}

/// How many most likely tokens a request wants with each token's log-probability, if any.
/// Chat completions: `logprobs` a boolean, `top_logprobs` 0..=20 (only with `logprobs`);
/// completions: `logprobs` 0..=5, the OpenAI API's ranges.
fn parse_logprobs(
    obj: &serde_json::Map<String, Value>,
    chat: bool,
    num: impl Fn(&str) -> std::result::Result<Option<f64>, Response>,
) -> std::result::Result<Option<usize>, Response> {
    let bad = |msg: String, param: &str| error(StatusCode::BAD_REQUEST, msg, Some(param));
    let count = |k: &str, max: usize| -> std::result::Result<Option<usize>, Response> {
        match num(k)? {
            None => Ok(None),
            Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= max as f64 => Ok(Some(x as usize)),
            Some(x) => Err(bad(
                format!("`{k}` must be a whole number in 0..={max}, not {x}"),
                k,
            )),
        }
    };
    if !chat {
        return count("logprobs", 5);
    }
    let on = match obj.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`logprobs` must be a boolean".into(), "logprobs")),
    };
    let top = count("top_logprobs", MAX_TOP_LOGPROBS)?;
    if top.is_some() && !on {
        return Err(bad(
            "`top_logprobs` needs `logprobs` true".into(),
            "top_logprobs",
        ));
    }
    Ok(on.then(|| top.unwrap_or(0)))
}

/// Log-probabilities of a choice's tokens in its endpoint's shape (the OpenAI API reference:
/// chat `logprobs.content[]` of `{token, logprob, bytes, top_logprobs}`; completions
/// `logprobs` of `tokens`, `token_logprobs`, `top_logprobs` (the sampled token's among them,
/// so up to `logprobs` + 1) and `text_offset`, character offsets from the prompt's start).
/// A token's text is its bytes, invalid UTF-8 replaced (a character split across tokens).
/// Tokens gather by [`LogprobsOut::push`]; [`LogprobsOut::take`] gives those since the
/// last take (all of them for a whole response, one per streamed chunk).
struct LogprobsOut {
    chat: bool,
    model: &'static DecoderModel,
    /// Characters before the next token (completions).
    offset: usize,
    entries: Vec<(u32, TokenLogprob)>,
}

impl LogprobsOut {
    fn push(&mut self, token: u32, lp: TokenLogprob) {
        self.entries.push((token, lp));
    }

    fn spell(&self, t: u32) -> (String, Vec<u8>) {
        let mut b = Vec::new();
        // An id the model sampled is in its vocabulary; an error would leave the text empty.
        let _ = self.model.tokenizer.token_bytes(t, &mut b);
        (String::from_utf8_lossy(&b).into_owned(), b)
    }

    fn take(&mut self) -> Value {
        let entries = std::mem::take(&mut self.entries);
        if self.chat {
            let item = |t: u32, lp: f32| {
                let (text, bytes) = self.spell(t);
                json!({"token": text, "logprob": lp, "bytes": bytes})
            };
            let content: Vec<Value> = entries
                .iter()
                .map(|(t, lp)| {
                    let mut e = item(*t, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(i, p)| item(i, p)).collect();
                    e
                })
                .collect();
            return json!({"content": content, "refusal": null});
        }
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (t, lp) in &entries {
            let text = self.spell(*t).0;
            let mut top = serde_json::Map::new();
            for &(i, p) in lp.top.iter().chain([&(*t, lp.logprob)]) {
                top.insert(self.spell(i).0, json!(p));
            }
            offsets.push(self.offset);
            self.offset += text.chars().count();
            tokens.push(text);
            lps.push(lp.logprob);
            tops.push(Value::Object(top));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
               "text_offset": offsets})
    }
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
    let (req, stream, prompt_chars) = match parse(&state, &body, chat) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let n_prompt = req.prompt.len();
    let logprobs = req.logprobs.is_some().then_some(LogprobsOut {
        chat,
        model: state.model,
        offset: prompt_chars,
        entries: Vec::new(),
    });
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
        streamed(reply, rx, logprobs)
    } else {
        whole(reply, rx, logprobs).await
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
    fn choice(&self, text: &str, finish: Option<&str>, first: bool, logprobs: Value) -> Value {
        if self.chat && self.stream {
            let mut delta = json!({"content": text});
            if first {
                delta["role"] = json!("assistant");
            }
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens})
}

/// The events as server-sent events: a chunk per token, the last with the finish reason and
/// the usage, then `[DONE]`.
fn streamed(
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Msg>,
    logprobs: Option<LogprobsOut>,
) -> Response {
    // Stages: 0 events, 1 the closing `[DONE]`, 2 the end.
    let init = (rx, 0u8, true, logprobs);
    let s = futures_util::stream::unfold(init, move |(mut rx, stage, first, mut lps)| {
        let reply = reply.clone();
        let sse = |d: String| Ok::<_, std::convert::Infallible>(SseEvent::default().data(d));
        async move {
            match stage {
                0 => {}
                1 => return Some((sse("[DONE]".into()), (rx, 2, false, lps))),
                _ => return None,
            }
            let mut v = reply.head();
            let stage = match rx.recv().await {
                Some(Msg::Event(Event::Token {
                    token,
                    text,
                    logprob,
                    ..
                })) => {
                    let lp = match (&mut lps, logprob) {
                        (Some(out), Some(lp)) => {
                            out.push(token, lp);
                            out.take()
                        }
                        _ => Value::Null,
                    };
                    v["choices"] = json!([reply.choice(&text, None, first, lp)]);
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
                    v["choices"] = json!([reply.choice(&text, finish, first, Value::Null)]);
                    v["usage"] = usage(prompt_tokens, completion_tokens);
                    1
                }
                Some(Msg::Failed(e)) => {
                    v = json!({"error": {"message": e, "type": "server_error"}});
                    2
                }
                None => return None,
            };
            Some((sse(v.to_string()), (rx, stage, false, lps)))
        }
    });
    Sse::new(s).into_response()
}

/// The events gathered into one response.
async fn whole(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    mut logprobs: Option<LogprobsOut>,
) -> Response {
    let mut text = String::new();
    while let Some(m) = rx.recv().await {
        match m {
            Msg::Event(Event::Token {
                token,
                text: t,
                logprob,
                ..
            }) => {
                text.push_str(&t);
                if let (Some(out), Some(lp)) = (&mut logprobs, logprob) {
                    out.push(token, lp);
                }
            }
            Msg::Event(Event::Finished {
                reason,
                text: t,
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                text.push_str(&t);
                let mut body = reply.head();
                let lp = logprobs.as_mut().map_or(Value::Null, LogprobsOut::take);
                let finish = Some(finish_name(reason));
                body["choices"] = json!([reply.choice(&text, finish, true, lp)]);
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

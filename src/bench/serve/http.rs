//! The HTTP/1.1 client of `bench serve`, on blocking sockets (one thread per client): one
//! request per connection (`Connection: close`), bodies sized by `Content-Length`, chunked
//! (RFC 9112 section 7.1) or ended by the close, and server-sent events read line by line as
//! they arrive (html.spec.whatwg.org/multipage/server-sent-events.html: `data:` lines, the
//! OpenAI stream ending with `data: [DONE]`).

use metashard::{Error, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Where a server listens: `http://HOST:PORT`.
#[derive(Clone, Debug)]
pub struct Base {
    host: String,
    port: u16,
}

impl Base {
    /// `http://HOST[:PORT][/...]` (a path such as `/v1` is dropped; the port defaults to 80);
    /// an error naming `--url` otherwise.
    pub fn parse(url: &str) -> Result<Base> {
        let bad = |why: &str| Error::invalid_argument("--url", url, why.to_string());
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("must start with http:// (TLS is not spoken)"))?;
        let authority = rest.split('/').next().unwrap_or("");
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("has a port that is not a number in 0..=65535"))?,
            ),
            None => (authority, 80),
        };
        if host.is_empty() {
            return Err(bad("names no host"));
        }
        Ok(Base {
            host: host.to_string(),
            port,
        })
    }

    pub fn local(addr: SocketAddr) -> Base {
        Base {
            host: addr.ip().to_string(),
            port: addr.port(),
        }
    }
}

impl std::fmt::Display for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}:{}", self.host, self.port)
    }
}

/// A streamed completion as it arrived.
#[derive(Clone, Debug)]
pub struct Stream {
    pub text: String,
    /// The usage's `completion_tokens`, else the chunks that carried a token.
    pub tokens: usize,
    /// Seconds from sending the request to the first token.
    pub ttft: f64,
    /// Seconds between consecutive tokens.
    pub gaps: Vec<f64>,
}

pub struct Client {
    pub base: Base,
    pub api_key: Option<String>,
    /// Longest wait for a byte from the server.
    pub timeout: Duration,
}

/// A chunked body (RFC 9112 section 7.1): sizes in hexadecimal, each chunk followed by CRLF,
/// a chunk of size 0 (and trailers) at the end.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = usize::from_str_radix(size, 16).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a chunk size of {line:?}"),
                )
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = self.left.min(buf.len());
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

impl Client {
    /// Send one request; the status and the body as a reader.
    fn send(
        &self,
        method: &str,
        path: &str,
        body: &str,
    ) -> std::io::Result<(u16, Box<dyn BufRead>)> {
        let addr = (self.base.host.as_str(), self.base.port)
            .to_socket_addrs()?
            .next()
            .ok_or(std::io::ErrorKind::AddrNotAvailable)?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_nodelay(true)?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
            self.base.host,
            self.base.port,
            body.len()
        );
        if let Some(k) = &self.api_key {
            head += &format!("Authorization: Bearer {k}\r\n");
        }
        s.write_all(format!("{head}\r\n{body}").as_bytes())?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("status {line:?}"))
            })?;
        let (mut chunked, mut length) = (false, None);
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            let (k, v) = line.split_once(':').unwrap_or((&line, ""));
            match k.trim().to_ascii_lowercase().as_str() {
                "transfer-encoding" => chunked = v.to_ascii_lowercase().contains("chunked"),
                "content-length" => length = v.trim().parse::<u64>().ok(),
                _ => {}
            }
        }
        let body: Box<dyn BufRead> = match (chunked, length) {
            (true, _) => Box::new(BufReader::new(Chunked {
                inner: r,
                left: 0,
                done: false,
            })),
            (false, Some(n)) => Box::new(r.take(n)),
            (false, None) => Box::new(r),
        };
        Ok((status, body))
    }

    /// GET or POST `path`, the whole body as JSON (or text) when the status is 200; else an
    /// error with the status and the server's message.
    fn fetch(&self, method: &str, path: &str) -> std::result::Result<String, String> {
        let (status, body) = self.send(method, path, "").map_err(|e| e.to_string())?;
        let mut text = String::new();
        body.take(16 << 20)
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("HTTP {status}: {}", error_message(&text)));
        }
        Ok(text)
    }

    /// Wait until `/health` answers 200 (llama-server answers 503 while it loads), within
    /// the client's timeout; an error naming `--url` with the last answer otherwise.
    pub fn wait_healthy(&self) -> Result<()> {
        let t0 = Instant::now();
        loop {
            match self.fetch("GET", "/health") {
                Ok(_) => return Ok(()),
                Err(e) if t0.elapsed() > self.timeout => {
                    return Err(Error::invalid_argument(
                        "--url",
                        self.base.to_string(),
                        format!("not healthy after {:.0} s: {e}", self.timeout.as_secs_f64()),
                    ));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }

    /// The first model `/v1/models` lists (`default` where the list is empty).
    pub fn model_name(&self) -> Result<String> {
        let text = self
            .fetch("GET", "/v1/models")
            .map_err(|e| Error::invalid_argument("--url", self.base.to_string(), e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            Error::invalid_argument("--url", self.base.to_string(), format!("/v1/models: {e}"))
        })?;
        Ok(v["data"][0]["id"].as_str().unwrap_or("default").to_string())
    }

    /// Requests running or queued, from `metashard serve`'s `/metrics`.
    pub fn held(&self) -> std::result::Result<f64, String> {
        let text = self.fetch("GET", "/metrics")?;
        let get = |name: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(name)?
                        .strip_prefix(' ')?
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .ok_or_else(|| format!("/metrics has no {name}"))
        };
        Ok(get("metashard_requests_running")? + get("metashard_requests_queued")?)
    }

    /// POST a streamed completion (`body`, JSON) to `/v1/completions` and read it to
    /// `[DONE]`; an error names what went wrong (a status and the server's message, an event
    /// with an error, a stream ending early).
    pub fn complete(&self, body: &str) -> std::result::Result<Stream, String> {
        let t0 = Instant::now();
        let (status, mut r) = self
            .send("POST", "/v1/completions", body)
            .map_err(|e| e.to_string())?;
        if status != 200 {
            let mut text = String::new();
            let _ = r.take(1 << 20).read_to_string(&mut text);
            return Err(format!("HTTP {status}: {}", error_message(&text)));
        }
        let (mut text, mut arrivals, mut usage, mut done) =
            (String::new(), Vec::new(), None, false);
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
                break;
            }
            let at = t0.elapsed().as_secs_f64();
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim_start();
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: Value =
                serde_json::from_str(data).map_err(|e| format!("event {data:?}: {e}"))?;
            if v.get("error").is_some() {
                return Err(format!("an error event: {}", error_message(data)));
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
            let Some(c) = v["choices"].get(0) else {
                continue;
            };
            let t = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .unwrap_or("");
            // A chunk that only closes the stream carries no token.
            if c["finish_reason"].is_null() || !t.is_empty() {
                arrivals.push(at);
            }
            text.push_str(t);
        }
        if !done {
            return Err(format!(
                "the stream ended without [DONE] after {} tokens",
                arrivals.len()
            ));
        }
        let Some(&first) = arrivals.first() else {
            return Err("a stream without tokens".into());
        };
        Ok(Stream {
            text,
            tokens: usage.unwrap_or(arrivals.len()),
            ttft: first,
            gaps: arrivals.windows(2).map(|w| w[1] - w[0]).collect(),
        })
    }
}

/// The message of an OpenAI-style error body, else the body itself (cut short).
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| body.chars().take(200).collect())
}

#[cfg(test)]
mod tests {
    use super::{Base, Chunked};
    use std::io::Read;

    #[test]
    fn chunked_bodies_decode() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        let mut c = Chunked {
            inner: &raw[..],
            left: 0,
            done: false,
        };
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello, world");
    }

    #[test]
    fn urls_parse_or_name_the_flag() {
        assert_eq!(
            Base::parse("http://127.0.0.1:8080/v1").unwrap().to_string(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(Base::parse("http://localhost").unwrap().port, 80);
        for bad in ["https://x:1", "http://:80", "http://x:port"] {
            assert!(
                Base::parse(bad).unwrap_err().to_string().contains("--url"),
                "{bad}"
            );
        }
    }
}

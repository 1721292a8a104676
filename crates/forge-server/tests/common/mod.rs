//! A small blocking HTTP/1.1 client over loopback for the server tests (no HTTP crate needed).
#![allow(dead_code)]

use serde_json::Value as Json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Json {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        sse_data(&self.body)
    }

    /// The parsed SSE chunks before `[DONE]` (asserting that it ends the stream).
    pub fn chunks(&self) -> Vec<Json> {
        let data = self.sse();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]: {}", self.body);
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
    }
}

pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|ev| ev.strip_prefix("data: ")).map(str::to_string).collect()
}

fn head(method: &str, path: &str, len: usize, key: Option<&str>) -> String {
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {len}\r\n{auth}\r\n"
    )
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = nl + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

/// One request on a fresh connection; reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8], key: Option<&str>) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    // The server may answer (e.g. 413) and close before reading everything we send.
    let _ = s.write_all(head(method, path, body.len(), key).as_bytes()).and_then(|_| s.write_all(body));
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP response to {method} {path}: {:?}", String::from_utf8_lossy(&raw)));
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = headers.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status code");
    let mut body = raw[split + 4..].to_vec();
    if headers.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Resp { status, headers, body: String::from_utf8_lossy(&body).to_string() }
}

pub fn post(addr: SocketAddr, path: &str, body: &Json, key: Option<&str>) -> Resp {
    request(addr, "POST", path, body.to_string().as_bytes(), key)
}

pub fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> Resp {
    request(addr, "GET", path, b"", key)
}

/// Starts a streaming request and returns the connection once the first `data:` event that
/// carries content has arrived (the caller then drops it: a client disconnecting mid-stream).
pub fn open_stream_until_content(addr: SocketAddr, path: &str, body: &Json, key: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let b = body.to_string();
    s.write_all(head("POST", path, b.len(), key).as_bytes()).unwrap();
    s.write_all(b.as_bytes()).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    for _ in 0..10_000 {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("stream ended before any content");
        }
        if line.starts_with("data: ") && (line.contains("\"content\":\"") && !line.contains("\"content\":\"\"")) {
            return s;
        }
    }
    panic!("no content in the stream");
}

/// Sends a request and hangs up after `wait` without reading the answer.
pub fn send_and_hang_up(addr: SocketAddr, path: &str, body: &Json, key: Option<&str>, wait: Duration) {
    let mut s = TcpStream::connect(addr).expect("connect");
    let b = body.to_string();
    s.write_all(head("POST", path, b.len(), key).as_bytes()).unwrap();
    s.write_all(b.as_bytes()).unwrap();
    std::thread::sleep(wait);
}

pub fn smollm2() -> std::path::PathBuf {
    forge_core::hub::resolve_model("smollm2", true).expect("SmolLM2 (run tools/setup.sh)")
}

pub fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

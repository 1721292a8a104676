//! A Hugging Face–compatible hub in memory, over HTTP/1.1 on 127.0.0.1 (std::net, a thread per
//! connection): the revision API and resolve URLs, with faults on demand (a connection cut
//! after N bytes, a wrong body, 404s, 503s, Range ignored). Shared by forge-hub's tests and
//! forge-cli's (which includes this file by path).
#![allow(dead_code)] // each test binary uses its own subset

use forge_core::release::sha256_bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug)]
pub struct MockFile {
    pub path: String,
    pub data: Vec<u8>,
    pub lfs: bool,
}

#[derive(Default)]
pub struct Repo {
    /// Branch and tag names to commits.
    pub refs: BTreeMap<String, String>,
    pub commits: BTreeMap<String, Vec<MockFile>>,
    /// Requests without `Authorization: Bearer {token}` get 401.
    pub token: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Request {
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
pub struct State {
    pub repos: BTreeMap<String, Repo>,
    pub requests: Vec<Request>,
    /// One-shot: the next transfer of this path stops after this many body bytes and the
    /// connection is closed.
    pub cut: HashMap<String, usize>,
    /// These paths are served with every byte flipped (same length).
    pub wrong_body: HashSet<String>,
    /// These paths answer 404 on resolve.
    pub missing: HashSet<String>,
    /// Answer this many 503s for the path before serving it.
    pub unavailable: HashMap<String, u32>,
    /// Answer range requests with 200 and the whole file.
    pub ignore_range: bool,
    /// LFS files redirect (302) to a content-addressed URL, as the Hub sends them to its CDN.
    pub redirect_lfs: bool,
}

pub struct MockHub {
    pub url: String,
    pub state: Arc<Mutex<State>>,
}

impl MockHub {
    pub fn start() -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State { redirect_lfs: true, ..Default::default() }));
        let s = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let s = s.clone();
                std::thread::spawn(move || {
                    let _ = serve(stream, &s);
                });
            }
        });
        MockHub { url, state }
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    /// Add a commit of `files` (path, contents, stored in LFS) and point `refs` at it.
    pub fn commit(&self, repo: &str, refs: &[&str], files: &[(&str, &[u8], bool)]) -> String {
        let mut id_src = repo.as_bytes().to_vec();
        for (p, d, _) in files {
            id_src.extend_from_slice(p.as_bytes());
            id_src.extend_from_slice(&sha256_bytes(d).into_bytes());
        }
        let mut state = self.state.lock().unwrap();
        let r = state.repos.entry(repo.to_string()).or_default();
        id_src.extend_from_slice(r.commits.len().to_string().as_bytes());
        let id = sha256_bytes(&id_src)[..40].to_string();
        let files = files.iter().map(|(p, d, l)| MockFile { path: p.to_string(), data: d.to_vec(), lfs: *l }).collect();
        r.commits.insert(id.clone(), files);
        for name in refs {
            r.refs.insert(name.to_string(), id.clone());
        }
        id
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn clear_requests(&self) {
        self.state.lock().unwrap().requests.clear();
    }
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Close the connection after this many body bytes.
    cut: Option<usize>,
}

impl Reply {
    fn new(status: u16, body: impl Into<Vec<u8>>) -> Reply {
        Reply { status, headers: Vec::new(), body: body.into(), cut: None }
    }
    fn header(mut self, k: &str, v: &str) -> Reply {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }
}

fn serve(stream: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let req = Request { path: target, headers };
    let reply = {
        let mut st = state.lock().unwrap();
        st.requests.push(req.clone());
        route(&mut st, &req)
    };
    let mut out = stream;
    let reason = match reply.status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Error",
    };
    let mut head =
        format!("HTTP/1.1 {} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n", reply.status, reply.body.len());
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    let n = reply.cut.unwrap_or(reply.body.len()).min(reply.body.len());
    out.write_all(&reply.body[..n])?;
    out.flush()?;
    let _ = out.shutdown(Shutdown::Both);
    Ok(())
}

fn authorized(repo: &Repo, req: &Request) -> bool {
    match &repo.token {
        None => true,
        Some(t) => req.header("authorization") == Some(&format!("Bearer {t}")),
    }
}

fn error(status: u16, code: &str, msg: &str) -> Reply {
    Reply::new(status, format!("{{\"error\":\"{msg}\"}}")).header("X-Error-Code", code).header("X-Error-Message", msg)
}

fn route(st: &mut State, req: &Request) -> Reply {
    let (path, _query) = req.path.split_once('?').unwrap_or((&req.path, ""));
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let (repo, rev) = match rest.split_once("/revision/") {
            Some((r, v)) => (decode(r), decode(v)),
            None => (decode(rest), "main".to_string()),
        };
        let Some(r) = st.repos.get(&repo) else { return error(404, "RepoNotFound", "Repository not found") };
        if !authorized(r, req) {
            return error(401, "RepoNotFound", "Invalid credentials in Authorization header");
        }
        let commit = r.refs.get(&rev).cloned().unwrap_or(rev.clone());
        let Some(files) = r.commits.get(&commit) else {
            return error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
        };
        let siblings: Vec<serde_json::Value> = files
            .iter()
            .map(|f| {
                let mut s = serde_json::json!({"rfilename": f.path, "size": f.data.len(), "blobId": &sha256_bytes(&f.data)[..40]});
                if f.lfs {
                    s["lfs"] = serde_json::json!({"sha256": sha256_bytes(&f.data), "size": f.data.len(), "pointerSize": 134});
                }
                s
            })
            .collect();
        let body = serde_json::json!({"_id": "x", "id": repo, "sha": commit, "siblings": siblings});
        return Reply::new(200, body.to_string()).header("Content-Type", "application/json");
    }
    if let Some(sha) = path.strip_prefix("/lfs-cdn/") {
        let (data, path) = st
            .repos
            .values()
            .flat_map(|r| r.commits.values().flatten())
            .find(|f| sha256_bytes(&f.data) == sha)
            .map(|f| (f.data.clone(), f.path.clone()))
            .unwrap_or_default();
        return file_reply(st, req, &path, data);
    }
    if let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") {
        let repo = decode(repo);
        let Some((rev, file)) = rest.split_once('/') else { return error(404, "EntryNotFound", "no path") };
        let (rev, file) = (decode(rev), decode(file));
        let Some(r) = st.repos.get(&repo) else { return error(404, "RepoNotFound", "Repository not found") };
        if !authorized(r, req) {
            return error(401, "RepoNotFound", "Invalid credentials in Authorization header");
        }
        let commit = r.refs.get(&rev).cloned().unwrap_or(rev.clone());
        let Some(files) = r.commits.get(&commit) else { return error(404, "RevisionNotFound", "Invalid rev id") };
        let Some(f) = files.iter().find(|f| f.path == file).cloned() else {
            return error(404, "EntryNotFound", "Entry not found");
        };
        if st.missing.contains(&file) {
            return error(404, "EntryNotFound", "Entry not found");
        }
        if f.lfs && st.redirect_lfs {
            return Reply::new(302, Vec::new()).header("Location", &format!("/lfs-cdn/{}", sha256_bytes(&f.data)));
        }
        return file_reply(st, req, &file, f.data);
    }
    Reply::new(404, "no route")
}

fn file_reply(st: &mut State, req: &Request, path: &str, mut data: Vec<u8>) -> Reply {
    if let Some(n) = st.unavailable.get_mut(path).filter(|n| **n > 0) {
        *n -= 1;
        return Reply::new(503, "busy");
    }
    if st.wrong_body.contains(path) {
        data.iter_mut().for_each(|b| *b = !*b);
    }
    let len = data.len();
    let start = req
        .header("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|r| r.parse::<usize>().ok());
    let mut reply = match start {
        Some(s) if !st.ignore_range => {
            if s >= len {
                return Reply::new(416, Vec::new()).header("Content-Range", &format!("bytes */{len}"));
            }
            Reply::new(206, data[s..].to_vec()).header("Content-Range", &format!("bytes {s}-{}/{len}", len - 1))
        }
        _ => Reply::new(200, data),
    };
    reply.cut = st.cut.remove(path);
    reply
}

/// Deterministic bytes that do not compress or repeat.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

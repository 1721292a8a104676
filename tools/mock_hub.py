#!/usr/bin/env python3
"""A local stand-in for a Hugging Face–compatible hub: serves directories as model repositories.

    python3 tools/mock_hub.py --port 8090 demo/smollm2-q4=out/bundle-q4 [REPO=DIR ...]
    forge download demo/smollm2-q4 --endpoint http://127.0.0.1:8090 --dir models/smollm2-q4

It answers the two requests `forge download` and `forge check-update` make: the revision API
(`GET /api/models/REPO/revision/REV?blobs=true`: the commit and every file with its size, and
for weight files the LFS SHA-256) and file downloads (`GET /REPO/resolve/REV/PATH`, with HTTP
ranges). A repository's commit is a hash of its file list, so changing a file changes the
commit; `main` always names the current one. Files whose names start with a dot are not served.
Standard library only; for trying the download path without network, and for the README's CI.
"""

import argparse
import hashlib
import json
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".forgecache", ".npy")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def scan(root):
    """Every served file of a directory: (relative path, size, sha256), sorted."""
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in sorted(names):
            if n.startswith("."):
                continue
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            files.append((rel, os.path.getsize(p), sha256_file(p)))
    files.sort()
    return files


class Repo:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.refresh()

    def refresh(self):
        self.files = scan(self.root)
        listing = "\n".join(f"{p} {s}" for p, _, s in self.files)
        self.commit = hashlib.sha1(listing.encode()).hexdigest()


class Handler(BaseHTTPRequestHandler):
    repos = {}
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        if os.environ.get("MOCK_HUB_LOG"):
            sys.stderr.write("mock_hub: " + fmt % args + "\n")

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def find_repo(self, parts):
        """The repository named by the first one or two path parts, and the rest."""
        for n in (2, 1):
            name = "/".join(parts[:n])
            if name in self.repos:
                return name, self.repos[name], parts[n:]
        return None, None, parts

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/") if p]
        if parts[:2] == ["api", "models"]:
            name, repo, rest = self.find_repo(parts[2:])
            if repo is None:
                return self.send_json(404, {"error": "Repository not found"})
            repo.refresh()
            rev = rest[1] if len(rest) == 2 and rest[0] == "revision" else "main"
            if rev not in ("main", repo.commit):
                return self.send_json(404, {"error": f"Invalid rev id: {rev}"})
            siblings = []
            for p, size, sha in repo.files:
                s = {"rfilename": p, "size": size}
                if p.endswith(LFS_SUFFIXES):
                    s["lfs"] = {"sha256": sha, "size": size, "pointerSize": 134}
                siblings.append(s)
            return self.send_json(200, {"id": name, "sha": repo.commit, "siblings": siblings})
        name, repo, rest = self.find_repo(parts)
        if repo is None or len(rest) < 3 or rest[0] != "resolve":
            return self.send_json(404, {"error": "Repository not found"})
        repo.refresh()
        rev, rel = rest[1], "/".join(rest[2:])
        if rev not in ("main", repo.commit):
            return self.send_json(404, {"error": f"Invalid rev id: {rev}"})
        entry = next((f for f in repo.files if f[0] == rel), None)
        if entry is None:
            return self.send_json(404, {"error": "Entry not found"})
        size = entry[1]
        start, end, code = 0, size, 200
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            start = int(first or 0)
            end = min(size, int(last) + 1) if last else size
            if start >= size and size > 0:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            code = 206
        self.send_response(code)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{entry[2]}"')
        self.send_header("X-Repo-Commit", repo.commit)
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(os.path.join(repo.root, rel), "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("repos", nargs="+", metavar="REPO=DIR", help="serve DIR as repository REPO (owner/name)")
    a = ap.parse_args()
    for spec in a.repos:
        name, sep, d = spec.partition("=")
        if not sep or not os.path.isdir(d):
            ap.error(f"{spec}: expected REPO=DIR with an existing directory")
        Handler.repos[name] = Repo(d)
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    print(f"mock_hub: serving {', '.join(Handler.repos)} on http://{a.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

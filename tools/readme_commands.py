#!/usr/bin/env python3
"""Run every command of README.md, as a newcomer would, from the repository root.

Every ```sh block of the README is read line by line (`\\` continuations joined, `#` comments
dropped) and each command runs in bash with `target/release` first on PATH, so `forge ...` is
the binary just built. A command ending in `&` starts in the background (a server); the next
command waits until the port it was given (`--port N`) accepts connections. ```python blocks
run with python3. The outputs the README writes (out/, models/) are removed first, so the run
starts as a fresh clone would. Two commands are not run here, and say why below: the test
command itself (this script is part of it) and the toolchain installer.

    python3 tools/readme_commands.py [--list] [--readme README.md]
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Commands the README shows but this script does not run, each with the reason.
NOT_RUN = {
    "bash tools/test.sh": "the test command: CI runs it, and it runs this script",
    "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh": "installs Rust, which CI's machine has",
}

# What the README's commands write, removed before the run.
OUTPUTS = ["out", "models"]


def blocks(text):
    """(language, body) of each fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def commands(body):
    cmds, cur = [], ""
    for line in body.splitlines():
        s = line.rstrip()
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1].rstrip() + " "
            continue
        cur += s
        # A trailing comment is the README's explanation, not part of the command.
        cmd = re.sub(r"\s+#\s.*$", "", cur).strip()
        cmds.append(cmd)
        cur = ""
    return cmds


def wait_port(port, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"readme: the background command exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise SystemExit(f"readme: nothing listened on port {port} after {timeout} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    a = ap.parse_args()
    steps = []
    for lang, body in blocks(open(a.readme, encoding="utf-8").read()):
        if lang in ("sh", "bash", "console"):
            steps += [("sh", c) for c in commands(body)]
        elif lang == "python":
            steps.append(("python", body))
    if a.list:
        for kind, c in steps:
            why = NOT_RUN.get(c)
            print(f"{kind:6} {'(not run: ' + why + ') ' if why else ''}{c if kind == 'sh' else c.splitlines()[0] + ' ...'}")
        return
    env = dict(os.environ)
    env["PATH"] = os.path.join(ROOT, "target", "release") + os.pathsep + env["PATH"]
    for d in OUTPUTS:
        shutil.rmtree(os.path.join(ROOT, d), ignore_errors=True)
    def untracked():
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True)
        return set(r.stdout.splitlines()) if r.returncode == 0 else set()

    before = untracked()
    background, passed, failed, skipped = [], 0, 0, 0
    pending_port = None
    try:
        for kind, c in steps:
            if kind == "sh" and c in NOT_RUN:
                print(f"readme: skip  {c}  ({NOT_RUN[c]})", flush=True)
                skipped += 1
                continue
            if pending_port is not None:
                wait_port(*pending_port)
                pending_port = None
            t0 = time.time()
            shown = c if kind == "sh" else "python3 <<README\n" + c + "README"
            print(f"readme: $ {shown}", flush=True)
            if kind == "sh" and c.endswith("&"):
                p = subprocess.Popen(["bash", "-c", "exec " + c[:-1].strip()], cwd=ROOT, env=env)
                background.append(p)
                m = re.search(r"--port[ =](\d+)", c)
                if m:
                    pending_port = (int(m.group(1)), p)
                passed += 1
                continue
            argv = ["bash", "-euo", "pipefail", "-c", c] if kind == "sh" else ["python3", "-c", c]
            r = subprocess.run(argv, cwd=ROOT, env=env)
            ok = r.returncode == 0
            passed += ok
            failed += not ok
            print(f"readme: {'ok' if ok else 'FAILED (exit %d)' % r.returncode} in {time.time() - t0:.1f} s", flush=True)
            if not ok:
                break
    finally:
        for p in background:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    # The README's commands write under out/ and models/ only (both ignored), never beside the code.
    stray = sorted(untracked() - before)
    if stray:
        print("readme: the commands left files in the repository:\n  " + "\n  ".join(stray))
        failed += 1
    print(f"readme: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

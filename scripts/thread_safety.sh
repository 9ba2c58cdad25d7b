#!/usr/bin/env bash
# Checks the lock annotations (common/thread_annotations.h) with clang's -Wthread-safety: each
# source file that uses them is compiled (syntax only) with clang++ and the flags the build
# gives it, and any warning fails the check. Needs build/compile_commands.json (scripts/build.sh).
#
#   scripts/thread_safety.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
db="$build/compile_commands.json"
[ -f "$db" ] || { echo "thread_safety: $db missing: run scripts/build.sh first" >&2; exit 2; }
command -v clang++ >/dev/null || { echo "thread_safety: clang++ not installed (apt-get install clang)" >&2; exit 2; }
# Every source file that takes or names an annotated lock (new files too, before git add).
mapfile -t files < <(git ls-files --cached --others --exclude-standard -- '*.cc' |
  xargs grep -l -e 'thread_annotations.h' -e 'MutexLock' | sort -u)
[ "${#files[@]}" -gt 0 ] || { echo "thread_safety: no annotated file" >&2; exit 1; }
python3 - "$db" "${files[@]}" <<'PY'
import json, os, shlex, subprocess, sys
db, files = sys.argv[1], sys.argv[2:]
entries = {os.path.realpath(e["file"]): e for e in json.load(open(db))}
failed = 0
for f in files:
    e = entries.get(os.path.realpath(f))
    if e is None:
        print(f"thread_safety: {f}: not in {db}"); failed = 1; continue
    args = shlex.split(e["command"]) if "command" in e else e["arguments"]
    keep, skip = [], False
    for a in args[1:]:
        if skip: skip = False; continue
        if a in ("-o", "-c"): skip = a == "-o"; continue
        if a.startswith("-W") or a.startswith("-f") and "sanitize" in a: continue
        if os.path.realpath(a) == os.path.realpath(f) if os.path.exists(a) else False: continue
        keep.append(a)
    cmd = ["clang++", *keep, "-fsyntax-only", "-Wthread-safety", "-Wthread-safety-beta",
           "-Werror=thread-safety", "-Wno-unknown-warning-option", os.path.realpath(f)]
    r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
    out = "\n".join(l for l in r.stderr.splitlines() if "thread-safety" in l or "error" in l)
    print(f"thread_safety: {f}: {'ok' if r.returncode == 0 else 'FAILED'}")
    if r.returncode != 0:
        print(r.stderr[-4000:]); failed = 1
sys.exit(failed)
PY

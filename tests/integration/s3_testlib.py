"""An S3 server for tests (moto's server mode on loopback), a small SigV4 client to fill
buckets, and a proxy that checks the SigV4 signature of every request passing through it.

moto (PyPI, pinned in scripts/requirements-venv.txt, in the project venv that
scripts/install_deps.sh makes) accepts any signature, so the proxy is what proves that the
daemon signs its requests the way AWS S3 and MinIO check them: paths and query strings in
canonical encoding, continuation tokens included. moto is more lenient than a real store in
other ways too; the CubeFS ObjectNode tests (tests/cubefs) stay the strict check.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import http.server
import os
import signal
import socket
import subprocess
import threading
import urllib.parse
from pathlib import Path
from typing import Optional

from cubefs_harness import free_tcp_port, project_venv_problem, project_venv_python, wait_until

ACCESS_KEY = "cubetorchfs-test"  # moto accepts any key pair
SECRET_KEY = "cubetorchfs-test-secret"
REGION = "us-east-1"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
START_TIMEOUT_S = 30.0


def s3_server_problem() -> Optional[str]:
    """Why moto's S3 server cannot run here, or None when it can."""
    return project_venv_problem("moto")


# --------------------------------------------------------------------------- SigV4


def uri_encode(s: str, keep_slash: bool) -> str:
    return urllib.parse.quote(s, safe="/~" if keep_slash else "~")


def canonical_query(raw_query: str) -> str:
    pairs = []
    for part in raw_query.split("&") if raw_query else []:
        name, _, value = part.partition("=")
        pairs.append((uri_encode(urllib.parse.unquote(name), False),
                      uri_encode(urllib.parse.unquote(value), False)))
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def signature(method: str, raw_path: str, raw_query: str, headers: dict[str, str],
              signed: list[str], amz_date: str, secret: str = SECRET_KEY,
              region: str = REGION) -> str:
    """The SigV4 signature S3 computes for a request (headers: lower-case names)."""
    canonical_uri = uri_encode(urllib.parse.unquote(raw_path), True) or "/"
    canonical_headers = "".join(f"{h}:{' '.join(headers[h].split())}\n" for h in signed)
    canonical = "\n".join([method, canonical_uri, canonical_query(raw_query), canonical_headers,
                           ";".join(signed), headers.get("x-amz-content-sha256", EMPTY_SHA256)])
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


class S3Client:
    """Just enough of an S3 client to create buckets and put objects, with SigV4."""

    def __init__(self, port: int, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY,
                 region: str = REGION) -> None:
        self.port = port
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def close(self) -> None:
        self.conn.close()

    def request(self, method: str, path: str, body: bytes = b"", query: str = "",
                extra: Optional[dict[str, str]] = None) -> tuple[int, bytes]:
        """One signed request; `query` raw (already encoded), `extra` more headers (signed)."""
        raw_path = uri_encode(path, True)
        amz_date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        headers = {"host": f"127.0.0.1:{self.port}", "x-amz-date": amz_date,
                   "x-amz-content-sha256": hashlib.sha256(body).hexdigest()}
        headers.update({k.lower(): v for k, v in (extra or {}).items()})
        signed = sorted(headers)
        sig = signature(method, raw_path, query, headers, signed, amz_date, self.secret_key,
                        self.region)
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key}/{amz_date[:8]}/{self.region}/s3/"
            f"aws4_request, SignedHeaders={';'.join(signed)}, Signature={sig}")
        headers["content-length"] = str(len(body))
        for attempt in range(2):  # the server may have closed an idle keep-alive connection
            try:
                target = raw_path + ("?" + query if query else "")
                self.conn.request(method, target, body=body, headers=headers)
                reply = self.conn.getresponse()
                return reply.status, reply.read()
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def create_bucket(self, bucket: str) -> None:
        status, body = self.request("PUT", f"/{bucket}")
        assert status == 200, (status, body)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        status, body = self.request("PUT", f"/{bucket}/{key}", data)
        assert status == 200, (key, status, body)

    def put_tree(self, bucket: str, root: Path, prefix: str = "") -> int:
        """Uploads every file under root as prefix + its relative path; returns the count."""
        count = 0
        for path in sorted(root.rglob("*")):
            if path.is_file():
                self.put(bucket, prefix + path.relative_to(root).as_posix(), path.read_bytes())
                count += 1
        return count


# --------------------------------------------------------------------------- moto


class S3Server:
    """One moto S3 server process on 127.0.0.1 (`python -m moto.server`, its own process so
    that pause() can freeze it); stop() is safe to call at any time, repeatedly.

    moto keeps its buckets in memory: a restarted server starts empty. Besides path-style URLs
    (http://127.0.0.1:PORT/bucket/key) it answers virtual-hosted ones at
    http://bucket.s3.localhost:PORT/key (`vhost_endpoint`): libcurl resolves *.localhost to the
    loopback address itself, without DNS. `directory` holds its log."""

    def __init__(self, directory: Path, port: Optional[int] = None) -> None:
        self.directory = directory
        self.port = port or free_tcp_port()
        self.proc: Optional[subprocess.Popen[bytes]] = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def vhost_endpoint(self) -> str:
        return f"http://s3.localhost:{self.port}"

    def start(self) -> "S3Server":
        log = open(self.directory / f"moto-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [str(project_venv_python()), "-m", "moto.server", "-H", "127.0.0.1", "-p",
             str(self.port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env=dict(os.environ, MOTO_ALLOW_NONEXISTENT_REGION="true"))
        log.close()
        if not wait_until(self._answers, START_TIMEOUT_S, interval=0.1):
            self.stop()
            raise RuntimeError(f"moto did not answer on port {self.port} in time "
                               f"(see {self.directory})")
        return self

    def _answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"moto exited with {self.proc and self.proc.returncode} "
                               f"(see {self.directory})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/moto-api/")
            conn.getresponse().read()
            conn.close()
            return True
        except OSError:
            return False

    def client(self) -> "S3Client":
        return S3Client(self.port)

    def pause(self) -> None:
        """Freezes the server: connections stay open and requests get no answer."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGKILL)  # SIGKILL works on a paused one too
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


# --------------------------------------------------------------------------- checking proxy


class SigV4CheckingProxy:
    """Forwards HTTP requests to an upstream S3 server after checking their SigV4 signature;
    a request whose signature does not match gets 403 SignatureDoesNotMatch, as from S3."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.checked = 0
        self.mismatches: list[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy.handle(self)

            def do_HEAD(self) -> None:
                proxy.handle(self)

            def do_PUT(self) -> None:
                proxy.handle(self)

            def do_POST(self) -> None:
                proxy.handle(self)

            def do_DELETE(self) -> None:
                proxy.handle(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def verify(self, req: http.server.BaseHTTPRequestHandler) -> Optional[str]:
        """Why the request's signature is wrong, or None when it is right."""
        auth = req.headers.get("Authorization", "")
        if not auth.startswith("AWS4-HMAC-SHA256 "):
            return f"no SigV4 Authorization header: {auth!r}"
        fields = dict(part.strip().split("=", 1) for part in auth[17:].split(","))
        headers = {k.lower(): v for k, v in req.headers.items()}
        signed = fields["SignedHeaders"].split(";")
        for required in ("host", "x-amz-date", "x-amz-content-sha256"):
            if required not in signed:
                return f"{required} is not signed: {signed}"
        raw_path, _, raw_query = req.path.partition("?")
        want = signature(req.command, raw_path, raw_query, headers, signed,
                         headers["x-amz-date"])
        if want != fields["Signature"]:
            return f"{req.command} {req.path}: signature mismatch"
        return None

    def handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        payload = req.rfile.read(length) if length else b""
        problem = self.verify(req)
        with self.lock:
            self.checked += 1
            if problem:
                self.mismatches.append(problem)
        if problem:
            req.close_connection = True
            body = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SignatureDoesNotMatch"
                    b"</Code><Message>signature mismatch</Message></Error>")
            req.send_response(403)
            req.send_header("Content-Type", "application/xml")
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(body)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() != "connection"}
            conn.request(req.command, req.path, body=payload if length else None, headers=headers)
            reply = conn.getresponse()
            body = reply.read()
            req.send_response(reply.status)
            for k, v in reply.getheaders():
                if k.lower() not in ("connection", "keep-alive", "transfer-encoding",
                                     "date", "server"):
                    req.send_header(k, v)
            if reply.getheader("Content-Length") is None:
                req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(body)
        finally:
            conn.close()


def wait_port_free(port: int, timeout: float = 10.0) -> bool:
    def free() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    return wait_until(free, timeout, interval=0.1)


def aws_example_signature() -> str:
    """The signature of AWS's documented example (GET /test.txt with a Range header), to check
    `signature` itself."""
    headers = {"host": "examplebucket.s3.amazonaws.com", "range": "bytes=0-9",
               "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": "20130524T000000Z"}
    return signature("GET", "/test.txt", "", headers, sorted(headers), "20130524T000000Z",
                     secret="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", region="us-east-1")

"""Starting `ggraph serve` for a test and talking to it over raw HTTP (http.client: bytes,
headers and streams exactly as sent), for tests/tools/test_serve*.py."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

from paths import ROOT

KEY = "sk-ggraph-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Any

    def request(self, method: str, path: str, body: Any = None, key: str | None = KEY,
                headers: dict[str, str] | None = None, timeout: float = 120.0
                ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            h = {"Content-Type": "application/json", **(headers or {})}
            if key is not None:
                h["Authorization"] = f"Bearer {key}"
            conn.request(method, path, raw, h)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        status, _, data = self.request("POST", path, body, **kw)
        return status, json.loads(data)

    def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        status, _, data = self.request("GET", path, **kw)
        return status, data

    def stream(self, path: str, body: dict, timeout: float = 120.0
               ) -> tuple[http.client.HTTPConnection, Iterator[str]]:
        """An open streaming request: the connection (close it to leave) and its SSE data
        lines."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 200, r.read()

        def lines() -> Iterator[str]:
            while True:
                line = r.readline()
                if not line:
                    return
                line = line.decode().strip()
                if line.startswith("data: "):
                    yield line[6:]
        return conn, lines()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


def start(*flags: str, model: str = "default", timeout: float = 600.0, tmp: Any) -> Server:
    """`ggraph serve` on a free localhost port, once /health answers 200."""
    port = free_port()
    log = open(os.path.join(str(tmp), f"serve-{port}.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ggraph.cli", "serve", "-m", model,
                             "--port", str(port), "-t", "2", *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    srv = Server(proc, port, log)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ggraph serve exited with {proc.returncode}:\n{srv.log_text()}")
        try:
            if srv.get("/health", key=None, timeout=5.0)[0] == 200:
                return srv
        except OSError:
            pass
        time.sleep(0.2)
    srv.stop(signal.SIGKILL)
    raise RuntimeError(f"ggraph serve did not answer /health in {timeout} s:\n"
                       f"{srv.log_text()}")

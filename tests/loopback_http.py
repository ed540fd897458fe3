"""What the loopback HTTP test doubles (fake_*_server.py) share: a quiet HTTP/1.1 handler that answers with
one body of known length, and a threaded server on a free 127.0.0.1 port that runs for a `with` block."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients under test use it

    def log_message(self, *args):
        pass

    def reply(self, status: int, payload: bytes, kind: str = "application/json", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(payload)


class LoopbackServer:
    """Serves a handler class on 127.0.0.1 (`self.port`: a free one), thread per request, inside `with`."""

    def serve(self, handler: type[QuietHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

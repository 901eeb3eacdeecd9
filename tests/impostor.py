"""A process that answers like a healthy server on a port it took (a fault test's impostor).

argv: port, the file each request path is appended to, the file created once it listens.
"""

import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

port, seen, ready = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        with seen.open("a") as f:
            f.write(f"{self.command} {self.path}\n")
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


server = HTTPServer(("127.0.0.1", port), Handler)
ready.touch()
server.serve_forever()

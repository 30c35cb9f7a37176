"""A FAKE KFP v2beta1 API server on 127.0.0.1 that records upload and run requests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class FakeKFP:
    def __init__(self, existing_pipeline: bool = False):
        self.requests: list[tuple[str, str, bytes]] = []
        self.pipelines = {"kubejax-yelp": "p-1"} if existing_pipeline else {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict, code: int = 200):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def do_GET(self):
                path = urlparse(self.path).path
                fake.requests.append(("GET", self.path, b""))
                if path.endswith("/healthz"):
                    return self._send({"multi_user": False})
                if path == "/apis/v2beta1/experiments":
                    return self._send({"experiments": []})
                if path == "/apis/v2beta1/pipelines":
                    items = [
                        {"pipeline_id": i, "display_name": n} for n, i in fake.pipelines.items()
                    ]
                    return self._send({"pipelines": items, "total_size": len(items)})
                if path.endswith("/versions"):
                    return self._send(
                        {
                            "pipeline_versions": [
                                {"pipeline_id": "p-1", "pipeline_version_id": "v-1"}
                            ]
                        }
                    )
                self._send({"error": "not found"}, 404)

            def do_POST(self):
                path = urlparse(self.path).path
                body = self._body()
                fake.requests.append(("POST", self.path, body))
                if path == "/apis/v2beta1/experiments":
                    e = json.loads(body)
                    return self._send({"experiment_id": "e-1", "display_name": e["display_name"]})
                if path == "/apis/v2beta1/pipelines/upload":
                    fake.pipelines["kubejax-yelp"] = "p-1"
                    return self._send({"pipeline_id": "p-1", "display_name": "kubejax-yelp"})
                if path == "/apis/v2beta1/pipelines/upload_version":
                    return self._send({"pipeline_id": "p-1", "pipeline_version_id": "v-2"})
                if path == "/apis/v2beta1/runs":
                    run = json.loads(body)
                    return self._send({**run, "run_id": "r-1", "state": "PENDING"})
                self._send({"error": "not found"}, 404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKFP:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def posted(self, path: str) -> list[bytes]:
        return [b for m, p, b in self.requests if m == "POST" and urlparse(p).path == path]

"""TrainJob progress: worker 0's status updates against a local HTTPS server with its own CA and
a rotating token file, throttled, and harmless when the server is away."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kubejax.trainer.train import main
from kubejax.trainer.trainer_status import StatusReporter
from tests.helpers import free_port, tiny_args


def _certificates(folder):
    """A CA, and a certificate for 127.0.0.1 it signed: (ca file, cert file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, key, signer, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    pem = serialization.Encoding.PEM
    files[0].write_bytes(cert("test-ca", "test-ca", ca_key, ca_key, True).public_bytes(pem))
    files[1].write_bytes(cert("127.0.0.1", "test-ca", key, ca_key, False).public_bytes(pem))
    files[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


class StatusServer:
    """Trainer's status endpoint, FAKE: records each POST's token and body."""

    def __init__(self, folder):
        self.ca, cert, key = _certificates(folder)
        self.posts: list[tuple[str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.posts.append((self.headers.get("Authorization", ""), body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        port = self.httpd.server_address[1]
        self.url = f"https://127.0.0.1:{port}/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/job/status"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path):
    s = StatusServer(tmp_path)
    yield s
    s.close()


def _wait_for(server, n):
    end = time.monotonic() + 10
    while len(server.posts) < n and time.monotonic() < end:
        time.sleep(0.01)
    return server.posts


def test_updates_are_throttled_carry_the_current_token_and_the_final_is_complete(server, tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    reporter = StatusReporter(server.url, str(server.ca), str(token), min_interval=0.3)
    reporter.update(1, 10, 90.4, {"loss": 1.5, "learning_rate": 1e-4})
    reporter.update(2, 10, 80.0, {"loss": 1.2})  # within the interval: noted, not sent
    auth, body = _wait_for(server, 1)[0]
    assert auth == "Bearer first"
    status = body["trainerStatus"]
    assert status["progressPercentage"] == 10 and status["estimatedRemainingSeconds"] == 90
    assert status["metrics"] == [{"name": "loss", "value": "1.5"},
                                 {"name": "learning_rate", "value": "0.0001"}]  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", status["lastUpdatedTime"])
    token.write_text("rotated\n")  # the projected token rotates: read at each request
    time.sleep(0.35)
    reporter.update(5, 10, None, {"eval_accuracy": 0.5})
    auth, body = _wait_for(server, 2)[1]
    assert auth == "Bearer rotated"
    names = {m["name"]: m["value"] for m in body["trainerStatus"]["metrics"]}
    assert names == {"loss": "1.2", "learning_rate": "0.0001", "eval_accuracy": "0.5"}
    assert "estimatedRemainingSeconds" not in body["trainerStatus"]
    reporter.finish(10, {"eval_accuracy": 0.75})
    final = server.posts[-1][1]["trainerStatus"]
    assert len(server.posts) == 3
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0


def test_a_server_away_costs_one_warning_and_no_time(tmp_path, capsys):
    ca = _certificates(tmp_path)[0]
    url = f"https://127.0.0.1:{free_port()}/status"
    reporter = StatusReporter(url, str(ca), None, min_interval=0.0, timeout=1.0)
    start = time.monotonic()
    for step in range(1, 4):
        reporter.update(step, 3, 1.0, {"loss": 1.0})
    assert time.monotonic() - start < 0.5  # the posts run beside the training
    reporter.finish(3, {})
    err = capsys.readouterr().err
    assert err.count("TrainJob progress not reported") == 1 and "training goes on" in err


def test_reporting_is_on_only_where_trainer_asks_for_it(tmp_path, capsys):
    assert StatusReporter.from_env({}) is None
    env = {"KUBEFLOW_TRAINER_SERVER_URL": "https://x/status",
           "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tmp_path / "missing.crt")}  # fmt: skip
    assert StatusReporter.from_env(env) is None
    assert "its CA certificate" in capsys.readouterr().err


@pytest.mark.slow
def test_fake_trainjob_worker_zero_reports_its_progress(
    server, tmp_path, monkeypatch, tiny_model_dir, prepared
):
    token = tmp_path / "token"
    token.write_text("t")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", server.url)
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", str(server.ca))
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
    args = tiny_args(tiny_model_dir, prepared, tmp_path / "out", max_steps=4, save_final=False)
    assert main(args) == 0
    first, last = server.posts[0][1]["trainerStatus"], server.posts[-1][1]["trainerStatus"]
    assert 0 < first["progressPercentage"] < 100 and "estimatedRemainingSeconds" in first
    assert last["progressPercentage"] == 100
    assert {"loss", "eval_accuracy", "eval_loss"} <= {m["name"] for m in last["metrics"]}

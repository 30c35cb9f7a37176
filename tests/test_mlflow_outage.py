"""The MLflow server going down mid-run: metrics logged meanwhile are retried and arrive once it
is back; those that never can are counted, reported and kept, never silently dropped.

The session's real `mlflow server` on 127.0.0.1 is reached through a TCP relay in this process,
and the tests cut the relay: it resets every open connection and refuses new ones, which is what a
client sees of a killed server, and it is back at once when restored (the server's own restart
takes about 10 s here). MLflow's own HTTP retries are turned off
(MLFLOW_HTTP_REQUEST_MAX_RETRIES=0), so every send during the outage fails at once and only
kubejax's retry can bring the metrics back.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
import subprocess
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from kubejax import tracking
from tests.helpers import free_port, tiny_args, trainer_cmd

NO_HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}


class Relay:
    """A TCP relay on 127.0.0.1 to a server's port that a test cuts (`stop`: open connections
    reset, new ones refused) and restores (`start`, on the same port)."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.up = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> Relay:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener, self.up = listener, True
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        self.up = False
        self._listener.close()
        with self._lock:
            for sock in self._open:
                # Linger 0: close sends a reset, as the kernel does for a killed process.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            while self.up and listener is self._listener:
                if not sel.select(timeout=0.05):
                    continue
                try:
                    client, _ = listener.accept()
                except OSError:
                    return
                with self._lock:
                    if not self.up:  # cut between the accept and now
                        client.close()
                        return
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                    self._open |= {client, upstream}
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # cut


@pytest.fixture
def server(mlflow_server, monkeypatch):
    """The session's server behind a relay of this test's own, on a free port: no connection
    a client pooled in an earlier test (through a relay cut and restored since) is reused. Two
    fresh-clone CI runs failed a run's creation on such connections, before any outage: each
    first request reset, its retry on a new connection served."""
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.2)
    relay = Relay(int(mlflow_server.rsplit(":", 1)[1])).start()
    yield relay
    relay.stop()


def _tracker(server, monkeypatch):
    """A run on the server, created with MLflow's own retries; every send after it without
    them (the tests' outages fail each send at once)."""
    tracker = tracking.create_tracker(server.uri, "outage", run_name="r")
    for k, v in NO_HTTP_RETRIES.items():
        monkeypatch.setenv(k, v)
    return tracker


def _log_steps(tracker, steps, pause=0.0):
    for step in steps:
        tracker.log_metrics({"loss": 1.0 / step}, step=step)
        time.sleep(pause)


def _wait_for_failed_sends(tracker, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not tracker._errors:
        assert time.monotonic() < deadline, "no send failed while the server was down"
        time.sleep(0.1)


def test_outage_metrics_logged_while_down_arrive_after_the_restart(server, monkeypatch):
    tracker = _tracker(server, monkeypatch)
    _log_steps(tracker, range(1, 21), pause=0.02)
    time.sleep(0.5)
    server.stop()
    _log_steps(tracker, range(21, 41), pause=0.02)
    _wait_for_failed_sends(tracker)
    server.start()
    _log_steps(tracker, range(41, 61), pause=0.02)
    assert tracker.finish() == []
    client = MlflowClient(server.uri)
    steps = sorted(m.step for m in client.get_metric_history(tracker.run_id, "loss"))
    assert steps == list(range(1, 61))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_outage_past_the_retries_is_counted_and_reported(server, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "FINISH_RETRY_SECONDS", 1.0)
    tracker = _tracker(server, monkeypatch)
    _log_steps(tracker, range(1, 11))
    time.sleep(0.5)
    server.stop()
    _log_steps(tracker, range(11, 21))
    with caplog.at_level(logging.WARNING, logger="kubejax.tracking"):
        lost = tracker.finish()
    assert sorted(step for key, _, _, step in lost if key == "loss") == list(range(11, 21))
    assert "10 metric values" in caplog.text and tracker.run_id in caplog.text


@pytest.mark.slow
def test_outage_during_training_loses_no_metric(server, tmp_path, tiny_model_dir, prepared):
    out, steps = tmp_path / "out", 800
    args = tiny_args(
        tiny_model_dir,
        prepared,
        out,
        max_steps=steps,
        eval_every=100,
        mlflow_tracking_uri=server.uri,
        mlflow_experiment="outage",
    )
    proc = subprocess.Popen(
        trainer_cmd(*args),
        env={**os.environ, **NO_HTTP_RETRIES},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def wait_for(predicate, what):
        deadline = time.monotonic() + 240
        while not predicate():
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    metrics = out / "metrics.json"
    wait_for(lambda: metrics.exists() and json.loads(metrics.read_text())["step"] >= 20, "step 20")
    server.stop()
    wait_for(lambda: any("will retry" in line for line in lines), "a failed send")
    during = json.loads(metrics.read_text())
    server.start()
    proc.wait(timeout=300)
    reader.join(10)
    output = "".join(lines)
    assert proc.returncode == 0, output
    done = json.loads(metrics.read_text())
    assert during["status"] == "running" and during["step"] < done["step"] == steps
    assert "delayed metric values sent" in output
    assert "mlflow_undelivered" not in done and not (out / "mlflow-undelivered.json").exists()
    history = MlflowClient(server.uri).get_metric_history(done["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == [r["step"] for r in done["train"]]


def test_undelivered_metrics_are_kept_beside_metrics_json(tmp_path, capsys):
    from kubejax.trainer.progress import Progress

    tracker = tracking.Tracker()
    tracker.run_id = "run-1"
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "completed", "step": 3}))
    progress = Progress(None, tmp_path, tracker, 3, [], {"train": [], "evals": []}, None)
    progress.undelivered([("loss", 0.5, 1700000000000, 2), ("loss", 0.4, 1700000000001, 3)])
    kept = json.loads((tmp_path / "mlflow-undelivered.json").read_text())
    assert kept["run_id"] == "run-1" and [m["step"] for m in kept["metrics"]] == [2, 3]
    assert json.loads((tmp_path / "metrics.json").read_text())["mlflow_undelivered"] == 2
    assert "2 metric values could not be delivered to MLflow run run-1" in capsys.readouterr().err

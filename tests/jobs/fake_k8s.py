"""A FAKE Kubernetes API server on 127.0.0.1 for the JAXJob and TrainJob backends' tests.

It records every request and plays a scripted list of status transitions: each GET of a job
moves it one step along `script` (the last step repeats). It answers API discovery for the
engines in `served`, and ClusterTrainingRuntime reads for the names in `runtimes`. Pods exist
once the job does (`<job>-worker-<i>` for a JAXJob, `<job>-node-0-<i>-x` with the JobSet and
completion-index labels for a TrainJob); their log is `log_lines`. Jobs get a uid; while a
job's step has a true `Suspended` condition, its Kueue Workload (listed by the job-uid label)
says `queue_reason`; a TrainJob's status carries `trainer_status` while it runs. Katib: a
created Experiment moves one step along `experiment_script` (statuses) at each GET; its Trials
are `katib_trials`. Trainer's OptimizationJob: a created one gets a uid and moves one step along
`optimization_script` (statuses) at each GET; `on_optimization_job` makes its trial TrainJobs
(a job stored with a `status` of its own keeps it).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(
    r"^/apis/(?:kubeflow\.org/v1|trainer\.kubeflow\.org/v1alpha1)/namespaces/([^/]+)/"
    r"(?:jaxjobs|trainjobs)(?:/([^/]+))?$"
)
RUNTIMES = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/clustertrainingruntimes/([^/]+)$")
DISCOVERY = {
    "/apis/kubeflow.org/v1": ("jaxjob", ["jaxjobs", "jaxjobs/status"]),
    "/apis/trainer.kubeflow.org/v1alpha1": (
        "trainjob",
        ["trainjobs", "trainjobs/status", "clustertrainingruntimes"],
    ),
}
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?(/log)?$")
KATIB = re.compile(
    r"^/apis/kubeflow\.org/v1beta1/namespaces/([^/]+)/(experiments|trials)(?:/([^/]+))?$"
)
OPTIMIZATION_JOBS = re.compile(
    r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/optimizationjobs(?:/([^/]+))?$"
)
WORKLOADS = re.compile(r"^/apis/kueue\.x-k8s\.io/v1beta2/namespaces/([^/]+)/workloads$")


def _suspended(conditions: list[dict]) -> bool:
    return any(c["type"] == "Suspended" and c["status"] == "True" for c in conditions)


def resumed(kind: str = "JAXJob") -> dict:
    """The `Suspended` condition once Kueue has admitted the job."""
    return {**condition("Suspended", "Resumed", f"{kind} resumed", kind), "status": "False"}


def condition(type_: str, reason: str = "", message: str = "", kind: str = "JAXJob") -> dict:
    return {
        "type": type_,
        "status": "True",
        "reason": reason or f"{kind}{type_}",
        "message": message or f"{kind} is {type_.lower()}.",
        "lastTransitionTime": "2026-12-02T00:00:00Z",
    }


class FakeKubernetes:
    """Start with `with FakeKubernetes(script=[...]) as fake:`; `fake.host` is the API URL."""

    def __init__(
        self,
        script: list[list[dict]] | None = None,
        log_lines: list[str] | None = None,
        failed_pod: int | None = None,
        served: tuple[str, ...] = ("jaxjob",),
        runtimes: tuple[str, ...] = ("jax-distributed",),
        queue_reason: tuple[str, str] = ("Pending", "waiting for quota"),
        trainer_status: dict | None = None,
        experiment_script: list[dict] | None = None,
        katib_trials: list[dict] | None = None,
        optimization_script: list[dict] | None = None,
    ):
        self.optimization_script = optimization_script or [{}]
        self.optimization_jobs: dict[str, dict] = {}
        self.on_optimization_job = None  # called with each created OptimizationJob
        self.experiment_script = experiment_script or [{}]
        self.katib_trials = katib_trials or []
        self.experiments: dict[str, dict] = {}
        self.on_experiment = None  # called with each created Experiment (a trial's doings)
        self.on_job = None  # called with each created job (what its trainer would write)
        self.served, self.runtimes = served, runtimes
        self.queue_reason, self.trainer_status = queue_reason, trainer_status
        self.script = script or (
            [[], [], [condition("Complete", kind="TrainJob")]]
            if served == ("trainjob",)
            else [
                [condition("Created")],
                [condition("Created"), condition("Running")],
                [condition("Created"), condition("Running"), condition("Succeeded")],
            ]
        )
        self.log_lines = log_lines or ["step 1/2 | loss 1.0", "step 2/2 | loss 0.5"]
        self.failed_pod = failed_pod
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        self.jobs: dict[str, dict] = {}
        self.steps: dict[str, int] = {}
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body, content_type="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _not_found(self, what):
                self._send(
                    404,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "NotFound",
                        "code": 404,
                        "message": f"{what} not found",
                    },
                )

            def do_POST(self):
                fake.record("POST", self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                name = body["metadata"]["name"]
                if OPTIMIZATION_JOBS.match(urlparse(self.path).path):
                    if name in fake.optimization_jobs:
                        exists = {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
                        return self._send(409, {**exists, "status": "Failure"})
                    body["metadata"]["uid"] = f"uid-{name}"
                    fake.optimization_jobs[name] = {**body, "step": 0}
                    if fake.on_optimization_job is not None:
                        fake.on_optimization_job(body)
                    return self._send(201, body)
                if KATIB.match(urlparse(self.path).path):
                    fake.experiments[name] = {**body, "step": 0}
                    if fake.on_experiment is not None:
                        fake.on_experiment(body)
                    return self._send(201, body)
                with fake.lock:
                    if name in fake.jobs:
                        return self._send(
                            409,
                            {
                                "kind": "Status",
                                "code": 409,
                                "reason": "AlreadyExists",
                                "status": "Failure",
                            },
                        )
                    body["metadata"]["uid"] = f"uid-{name}"
                    fake.jobs[name] = body
                    fake.steps[name] = 0
                if fake.on_job is not None:
                    fake.on_job(body)
                self._send(201, body)

            def do_DELETE(self):
                fake.record("DELETE", self.path)
                k = KATIB.match(urlparse(self.path).path)
                if k and fake.experiments.pop(k.group(3), None) is not None:
                    return self._send(200, {"kind": "Status", "status": "Success"})
                o = OPTIMIZATION_JOBS.match(urlparse(self.path).path)
                if o and fake.optimization_jobs.pop(o.group(2) or "", None) is not None:
                    return self._send(200, {"kind": "Status", "status": "Success"})
                m = JOBS.match(urlparse(self.path).path)
                with fake.lock:
                    if not m or m.group(2) not in fake.jobs:
                        return self._not_found("jaxjob")
                    fake.jobs.pop(m.group(2))
                self._send(200, {"kind": "Status", "status": "Success"})

            def do_GET(self):
                fake.record("GET", self.path)
                url = urlparse(self.path)
                m = JOBS.match(url.path)
                if m:
                    if m.group(2) is None:
                        return self._send(200, {"items": [fake.job(n) for n in fake.jobs]})
                    if m.group(2) not in fake.jobs:
                        return self._not_found("jaxjob")
                    return self._send(200, fake.advance(m.group(2)))
                if url.path in DISCOVERY and DISCOVERY[url.path][0] in fake.served:
                    names = DISCOVERY[url.path][1]
                    return self._send(
                        200,
                        {"kind": "APIResourceList", "resources": [{"name": n} for n in names]},
                    )
                m = RUNTIMES.match(url.path)
                if m and "trainjob" in fake.served and m.group(1) in fake.runtimes:
                    return self._send(200, {"kind": "ClusterTrainingRuntime", "metadata": {}})
                o = OPTIMIZATION_JOBS.match(url.path)
                if o and o.group(2) in fake.optimization_jobs:
                    return self._send(200, fake.optimization_job(o.group(2)))
                k = KATIB.match(url.path)
                if k and k.group(2) == "trials":
                    return self._send(200, {"items": fake.katib_trials})
                if k and k.group(3) in fake.experiments:
                    return self._send(200, fake.experiment(k.group(3)))
                if WORKLOADS.match(url.path):
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    return self._send(200, {"items": fake.workloads(selector.split("=")[-1])})
                m = PODS.match(url.path)
                if m and m.group(2) is None:
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    job = selector.split("=")[-1]
                    return self._send(
                        200, {"kind": "PodList", "apiVersion": "v1", "items": fake.pods(job)}
                    )
                if m and m.group(3):
                    text = "\n".join(fake.log_lines) + "\n"
                    return self._send(200, text.encode(), "text/plain")
                if m:
                    pod = next(
                        (
                            p
                            for j in fake.jobs
                            for p in fake.pods(j)
                            if p["metadata"]["name"] == m.group(2)
                        ),
                        None,
                    )
                    return self._send(200, pod) if pod else self._not_found("pod")
                self._not_found(url.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"

    def record(self, method: str, path: str) -> None:
        with self.lock:
            self.requests.append((method, path))

    def job(self, name: str) -> dict:
        obj = dict(self.jobs[name])
        if "status" in obj:  # a trial TrainJob as its test made it
            return obj
        conditions = self.script[min(self.steps[name], len(self.script) - 1)]
        if obj["kind"] == "TrainJob":
            done = any(c["type"] in ("Complete", "Failed") for c in conditions)
            obj["status"] = {
                "conditions": conditions,
                "jobsStatus": [{"name": "node", "active": 0 if done else 1}],
            }
            if self.trainer_status and not done and not _suspended(conditions):
                obj["status"]["trainerStatus"] = self.trainer_status
        else:
            obj["status"] = {
                "conditions": conditions,
                "replicaStatuses": {"Worker": {"active": 1}},
            }
        return obj

    def advance(self, name: str) -> dict:
        with self.lock:
            obj = self.job(name)
            self.steps[name] += 1
        return obj

    def pods(self, job: str) -> list[dict]:
        if job not in self.jobs:
            return []
        if self.jobs[job]["kind"] == "TrainJob":
            n = self.jobs[job]["spec"]["trainer"].get("numNodes", 1)
            return [
                {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "metadata": {
                        "name": f"{job}-node-0-{i}-x",
                        "namespace": "ns",
                        "labels": {
                            "jobset.sigs.k8s.io/jobset-name": job,
                            "batch.kubernetes.io/job-completion-index": str(i),
                        },
                    },
                    "status": {"phase": "Failed" if i == self.failed_pod else "Running"},
                }
                for i in range(n)
            ]
        n = self.jobs[job]["spec"]["jaxReplicaSpecs"]["Worker"].get("replicas", 1)
        return [
            {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {
                    "name": f"{job}-worker-{i}",
                    "namespace": "ns",
                    "labels": {"training.kubeflow.org/job-name": job},
                },
                "status": {"phase": "Failed" if i == self.failed_pod else "Running"},
            }
            for i in range(n)
        ]

    def experiment(self, name: str) -> dict:
        with self.lock:
            exp = self.experiments[name]
            status = self.experiment_script[min(exp["step"], len(self.experiment_script) - 1)]
            exp["step"] += 1
        return {**{k: v for k, v in exp.items() if k != "step"}, "status": status}

    def optimization_job(self, name: str) -> dict:
        with self.lock:
            job = self.optimization_jobs[name]
            status = self.optimization_script[min(job["step"], len(self.optimization_script) - 1)]
            job["step"] += 1
        return {**{k: v for k, v in job.items() if k != "step"}, "status": status}

    def workloads(self, uid: str) -> list[dict]:
        """Kueue's Workload of the job with `uid`: QuotaReserved false while it is suspended."""
        name = uid.removeprefix("uid-")
        if name not in self.jobs:
            return []
        step = self.script[min(max(self.steps[name] - 1, 0), len(self.script) - 1)]
        reserved = not _suspended(step)
        reason, message = self.queue_reason
        cond = {"type": "QuotaReserved", "status": str(reserved),
                "reason": "QuotaReserved" if reserved else reason, "message": message}  # fmt: skip
        return [{"metadata": {"labels": {"kueue.x-k8s.io/job-uid": uid}},
                 "status": {"conditions": [cond]}}]  # fmt: skip

    def count(self, method: str, fragment: str = "") -> int:
        return sum(1 for m, p in self.requests if m == method and fragment in p)

    def __enter__(self) -> FakeKubernetes:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def client_configuration(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.host
        return cfg

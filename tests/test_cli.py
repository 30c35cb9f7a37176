"""The kubejax command line: help, jaxjob render/run, submit against a FAKE KFP API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubejax.cli import main
from tests.fake_kfp import FakeKFP
from tests.helpers import tiny_args

SUBCOMMANDS = [
    ["prepare"],
    ["render"],
    ["launch"],
    ["jaxjob"],
    ["jaxjob", "render"],
    ["jaxjob", "run"],
    ["tune"],
    ["evaluate"],
    ["compile"],
    ["run"],
    ["submit"],
]


@pytest.mark.parametrize("cmd", SUBCOMMANDS, ids=[" ".join(c) for c in SUBCOMMANDS])
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*cmd, "--help"])
    assert exit_.value.code == 0
    assert "usage: kubejax" in capsys.readouterr().out


def test_console_script_help():
    out = subprocess.run(
        [Path(sys.executable).parent / "kubejax", "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "submit" in out and "jaxjob" in out


def test_jaxjob_render_prints_a_manifest(capsys):
    code = main(
        [
            "jaxjob",
            "render",
            "--name",
            "demo",
            "--replicas",
            "3",
            "--gpus",
            "1",
            "--env",
            "A=1",
            "--",
            "--model",
            "bert",
            "--data-dir",
            "/d",
        ]
    )
    assert code == 0
    m = yaml.safe_load(capsys.readouterr().out)
    worker = m["spec"]["jaxReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    assert worker["replicas"] == 3 and container["args"] == ["--model", "bert", "--data-dir", "/d"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_jaxjob_render_rejects_a_bad_name(capsys):
    assert main(["jaxjob", "render", "--name", "Bad_Name"]) == 2
    assert "name:" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [["jaxjob", "run", "--local"], ["launch", "--engine", "local"]],
    ids=["jaxjob run --local", "launch --engine local"],
)
def test_local_run_of_two_workers(command, tmp_path, tiny_model_dir, prepared, capsys):
    out = tmp_path / "o"
    # 32 rows of up to 64 tokens a worker: more than one piece a step, summed in the step's
    # loop on each worker before the exchange.
    trainer = tiny_args(tiny_model_dir, prepared, out, max_steps=4, global_batch_size=64)
    code = main(
        [*command, "--replicas", "2", "--name", "cli-run", "--log-dir", str(tmp_path / "logs"),
         "--", *trainer]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "[worker-0]" in printed and "[worker-1]" in printed and "Succeeded" in printed
    assert json.loads((out / "metrics.json").read_text())["final"]["num_processes"] == 2


def test_render_trainjob_validates_against_the_crd(capsys):
    import jsonschema

    from tests.jobs.test_spec import unknown_fields

    crd = Path(__file__).parent / "data" / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml"
    schema = yaml.safe_load(crd.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    argv = ["render", "--engine", "trainjob", "--replicas", "3", "--gpus", "1", "--env", "A=1"]
    assert main([*argv, "--", "--model", "m"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    jsonschema.validate(manifest, schema)
    assert unknown_fields(manifest, schema) == []
    assert manifest["spec"]["trainer"]["numNodes"] == 3
    assert manifest["spec"]["trainer"]["args"] == ["--model", "m"]


def test_run_local_rejects_unknown_and_bad_params(tmp_path, capsys):
    assert main(["run", "--local", "--workdir", str(tmp_path), "--param", "nope=1"]) == 2
    assert "unknown parameter 'nope'" in capsys.readouterr().err
    assert main(["run", "--local", "--workdir", str(tmp_path), "--param", "max_trials=many"]) == 2
    assert "max_trials" in capsys.readouterr().err
    own = ["--param", "source=reviews.csv", "--profile", "demo"]
    assert main(["run", "--local", "--workdir", str(tmp_path), *own]) == 2
    assert "--profile: demo is sized for the embedded synthetic data" in capsys.readouterr().err


def test_submit_uploads_and_creates_a_run_on_a_fake_kfp(capsys):
    with FakeKFP() as fake:
        code = main(
            [
                "submit",
                "--host",
                fake.host,
                "--experiment",
                "exp",
                "--param",
                "max_trials=3",
                "--param",
                "source=s3://bucket/yelp",
            ]
        )
        assert code == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == f"{fake.host}/#/runs/details/r-1"
        uploads = fake.posted("/apis/v2beta1/pipelines/upload")
        assert len(uploads) == 1 and b"kubejax-yelp" in uploads[0]
        run = json.loads(fake.posted("/apis/v2beta1/runs")[0])
        assert run["experiment_id"] == "e-1"
        assert run["pipeline_version_reference"] == {
            "pipeline_id": "p-1",
            "pipeline_version_id": "v-1",
        }
        assert run["runtime_config"]["parameters"] == {
            "max_trials": 3,
            "source": "s3://bucket/yelp",
        }


def test_submit_adds_a_version_to_an_existing_pipeline(capsys):
    with FakeKFP(existing_pipeline=True) as fake:
        assert main(["submit", "--host", fake.host]) == 0
        assert len(fake.posted("/apis/v2beta1/pipelines/upload_version")) == 1
        run = json.loads(fake.posted("/apis/v2beta1/runs")[0])
        assert run["pipeline_version_reference"]["pipeline_version_id"] == "v-2"


def test_submit_rejects_unknown_params(capsys):
    assert main(["submit", "--host", "http://127.0.0.1:9", "--param", "nope=1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err


def _kubeconfig(tmp_path, host: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": host}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


def _error_cases(tmp_path, trained_tiny, prepared, fake_host):
    space = '{"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": true}}'
    tune = ["tune", "--data-dir", str(prepared), "--model", "m", "--output-dir", str(tmp_path)]
    return {
        "CliError": (["render", "--env", "NOEQUALS", "--", "--model", "m"], "--env:"),
        "SpecError": (["render", "--replicas", "-1", "--", "--model", "m"], "replicas:"),
        "TPUError": (
            [
                "render",
                "--accelerator",
                "tpu-v5p-slice",
                "--tpu-topology",
                "2x4",
                "--",
                "--model",
                "m",
            ],
            "--tpu-topology: '2x4' is not a tpu-v5p-slice slice; one of 2x2x1, 2x2x2",
        ),
        "TokenizerError": (
            [
                "prepare",
                "--tokenizer",
                str(tmp_path / "none"),
                "--source",
                "x.csv",
                "--output",
                str(tmp_path / "p"),
            ],
            "tokenizer",
        ),
        "PrepareError": (
            [
                "prepare",
                "--tokenizer",
                str(trained_tiny / "model"),
                "--source",
                str(tmp_path / "missing.csv"),
                "--max-length",
                "64",
                "--output",
                str(tmp_path / "p2"),
            ],
            "source:",
        ),
        "EvaluationError": (
            ["evaluate", "--model-dir", str(tmp_path), "--data-dir", str(prepared)],
            "model:",
        ),
        "DatasetError": (
            [
                "evaluate",
                "--model-dir",
                str(trained_tiny / "model"),
                "--data-dir",
                str(tmp_path / "no-data"),
            ],
            "data_dir",
        ),
        "SweepError": ([*tune, "--space", "{}"], "search_space:"),
        "ConfigError": (
            [*tune, "--space", space, "--hyperparameters", '{"schedule": "cosin"}'],
            "schedule: 'cosin' is not one of",
        ),
        "TrackingError": (
            [*tune, "--space", space, "--mlflow-tracking-uri", "http://127.0.0.1:9"],
            "mlflow_tracking_uri:",
        ),
        "EngineNotFoundError": (
            ["launch", "--engine", "kubernetes", "--", "--model", "m"],
            "neither TrainJob",
        ),
        "FlagError": (
            [*tune, "--space", space, "--hyperparameters", '{"shedule": "cosine"}'],
            "hyperparameters: 'shedule' is not a setting",
        ),
        "InfeasibleError": (
            ["plan", "--device-memory", "1MiB", "--", "--model", "scratch", "--tokenizer", "-"],
            "device_memory: the run needs",
        ),
    }


ERROR_CLASSES = [
    "CliError",
    "SpecError",
    "TPUError",
    "TokenizerError",
    "PrepareError",
    "EvaluationError",
    "DatasetError",
    "SweepError",
    "ConfigError",
    "TrackingError",
    "EngineNotFoundError",
    "FlagError",
    "InfeasibleError",
]


def test_every_error_class_reaches_the_user_as_one_line(
    tmp_path, trained_tiny, prepared, capsys, monkeypatch
):
    """Each kind of error a user can cause: exit status 2, one line naming the setting, no
    traceback (the cluster case against a FAKE API server that serves neither engine)."""
    import kubejax.errors
    from tests.jobs.fake_k8s import FakeKubernetes

    with FakeKubernetes(served=()) as fake:
        monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, fake.host))
        cases = _error_cases(tmp_path, trained_tiny, prepared, fake.host)
        assert sorted(cases) == sorted(ERROR_CLASSES)
        for name, (argv, expected) in cases.items():
            cls = next(c for c in _subclasses(kubejax.errors.KubejaxError) if c.__name__ == name)
            assert issubclass(cls, kubejax.errors.KubejaxError)
            assert main(argv) == 2, name
            err = capsys.readouterr().err
            assert expected in err, (name, err)
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)


def _subclasses(cls) -> list[type]:
    import kubejax.cli
    import kubejax.data.prepare
    import kubejax.evaluate
    import kubejax.flags
    import kubejax.jobs.client
    import kubejax.tpu
    import kubejax.tune  # noqa: F401

    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out

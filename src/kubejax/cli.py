"""The `kubejax` command line.

kubejax prepare --tokenizer MODEL --source FILE_OR_HUB_ID --output DIR
kubejax render --engine {trainjob,jaxjob} [options] -- TRAINER_ARGS
kubejax launch --engine {auto,local,trainjob,jaxjob} --replicas N [options] -- TRAINER_ARGS
kubejax render --accelerator tpu-v5-lite-podslice --tpu-topology 4x4 -- TRAINER_ARGS
kubejax jaxjob render|run ...   (the same as render/launch with the JAXJob engine)
kubejax plan --replicas N --devices-per-worker G [--device-memory 80GiB] -- TRAINER_ARGS
kubejax plan --accelerator tpu-v6e-slice --tpu-topology 2x4 -- TRAINER_ARGS
kubejax tune --data-dir DIR --model MODEL --space JSON [options]
kubejax evaluate --model-dir DIR --data-dir DIR
kubejax compile [--output-dir compiled]
kubejax run --local [--workdir DIR] [--param NAME=VALUE ...]
kubejax submit --host URL [--param NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kubejax import tpu
from kubejax.errors import KubejaxError
from kubejax.flags import add_flags, from_namespace
from kubejax.jobs.client import BACKENDS, in_cluster
from kubejax.version import IMAGE, __version__

EXIT_BAD_INPUT = 2
#: The job options' names, for the accelerator settings' refusals (`place_workers`).
JOB_FLAGS = {
    "accelerator": "--accelerator",
    "tpu_topology": "--tpu-topology",
    "replicas": "--replicas",
    "devices_per_worker": "--tpus",
    "gpus_per_worker": "--gpus",
}
PLAN_FLAGS = {**JOB_FLAGS, "devices_per_worker": "--devices-per-worker"}
#: The compiled pipelines (`kubejax.pipelines.catalog`), named here without importing kfp.
PIPELINE_NAMES = ("kubejax-yelp", "kubejax-train-eval", "kubejax-llm")


class CliError(KubejaxError):
    """A bad command-line value; printed without a traceback, exit status 2."""


def _split_trainer_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


# ---------------------------------------------------------------------------------------------
# prepare


def _add_prepare(sub) -> None:
    from kubejax.data.prepare import PrepareConfig

    p = sub.add_parser(
        "prepare",
        help="Yelp reviews → tokenized dataset",
        description="Read, clean, split and tokenize reviews.",
    )
    p.add_argument("--output", required=True, help="output dataset folder (must not exist)")
    p.add_argument("--report", help="also write the HTML report here")
    add_flags(p, PrepareConfig, skip={"extra"})
    p.set_defaults(func=_prepare)


def _prepare(args) -> int:
    from kubejax.data.prepare import PrepareConfig, prepare_yelp, write_report

    cfg = from_namespace(PrepareConfig, args)
    meta = prepare_yelp(cfg, args.output)
    if args.report:
        write_report(meta, args.report)
    rows = {s: v["rows"] for s, v in meta["splits"].items()}
    print(
        json.dumps(
            {
                "output": args.output,
                "rows": rows,
                "num_labels": meta["num_labels"],
                "dropped": meta["dropped"],
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------
# jaxjob


def _model_config_option(q) -> None:
    q.add_argument(
        "--model-config",
        default="",
        metavar="PATH",
        help="the model's config.json (or a folder holding one) to plan from, where the model "
        "itself is only where the pods are (a volume, a hub id out of reach from here); "
        "without it, render skips the memory plan of such a model, saying so",
    )


def _accelerator_options(q, devices: str) -> None:
    q.add_argument(
        "--accelerator",
        default="",
        choices=tpu.ACCELERATORS,
        help=f"cpu, nvidia (GPUs: {devices}; the default) or a GKE TPU type, whose slice "
        "--tpu-topology names",
    )
    q.add_argument(
        "--tpu-topology",
        default="",
        help="the TPU slice's topology, e.g. 2x4 or 4x4 (GKE's cloud.google.com/gke-tpu-"
        "topology): its hosts are the workers, its chips per host each one's google.com/tpu",
    )


def _job_options(q) -> None:
    q.add_argument("--name", default="kubejax-train", help="job name (DNS-1035)")
    q.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="number of workers (nodes); 0: 1, or a TPU slice's hosts",
    )
    _accelerator_options(q, "--gpus")
    _model_config_option(q)
    q.add_argument(
        "--restart-policy",
        default="OnFailure",
        help="Never, OnFailure, Always or ExitCode (JAXJob; a TrainJob's come from its runtime)",
    )
    q.add_argument("--backoff-limit", type=int, default=3, help="group restarts allowed")
    q.add_argument("--active-deadline", type=int, default=None, help="activeDeadlineSeconds")
    q.add_argument(
        "--image",
        default="",
        help=f"worker image (default: {IMAGE}, or {tpu.TPU_IMAGE} on a TPU)",
    )
    q.add_argument("--namespace", default=None)
    q.add_argument("--cpu", default=None, help="CPU limit per worker, e.g. 4")
    q.add_argument("--memory", default=None, help="memory limit per worker, e.g. 16Gi")
    q.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu per worker")
    q.add_argument(
        "--tpus",
        type=int,
        default=0,
        help="google.com/tpu per worker; with a TPU --accelerator, the chips of a host (0: the "
        "slice's; a v5e or v6e 2x4 offers 8 on one host or 4 on two)",
    )
    q.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    _queue_options(q)


def _queue_options(q) -> None:
    q.add_argument(
        "--queue-name",
        default="",
        help="Kueue LocalQueue (label kueue.x-k8s.io/queue-name): the job waits, suspended, "
        "until Kueue admits it; its timeout counts from admission",
    )
    q.add_argument("--priority-class", default="", help="Kueue WorkloadPriorityClass")


def _add_render_and_launch(sub) -> None:
    r = sub.add_parser(
        "render",
        help="print the TrainJob or JAXJob manifest of a training as YAML (for kubectl)",
        description="Print the manifest; trainer flags follow '--'.",
    )
    r.add_argument("--engine", default="trainjob", choices=("trainjob", "jaxjob"))
    _job_options(r)
    r.set_defaults(func=_jaxjob_render)
    q = sub.add_parser(
        "launch",
        help="run a training as a TrainJob, a JAXJob or local processes, and wait for it",
        description="Launch the trainer; trainer flags follow '--'. --engine kubernetes or "
        "auto (in a pod) asks the cluster which engine it serves, TrainJob first.",
    )
    q.add_argument("--engine", default="auto", choices=BACKENDS)
    q.add_argument(
        "--env-contract",
        default="jaxjob",
        choices=("jaxjob", "trainjob"),
        help="local engine: which operator's environment the workers get",
    )
    _job_options(q)
    q.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait")
    q.add_argument("--log-dir", default=None, help="where worker logs go (local)")
    q.set_defaults(func=_jaxjob_run)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="the memory a training needs on each device, before any job starts",
        description="Print the memory plan (parameters, gradients, optimizer state, "
        "activations per device) of the trainer flags after '--' on replicas × devices; exit "
        "status 2 when it exceeds --device-memory (or the trainer's device_memory), naming the "
        "smallest mesh / micro-batch that fits.",
    )
    p.add_argument(
        "--replicas", type=int, default=0, help="workers (processes); 0: 1, or a TPU slice's hosts"
    )
    p.add_argument(
        "--devices-per-worker",
        type=int,
        default=0,
        help="devices (GPUs) a worker, 0: one; on a TPU the chips of a host (0: the slice's)",
    )
    _accelerator_options(p, "--devices-per-worker")
    _model_config_option(p)
    p.add_argument(
        "--device-memory",
        default="",
        help="memory of one device, e.g. 80GiB (default: a TPU chip's, else as the trainer says)",
    )
    p.set_defaults(func=_plan)


def _trainer_config(args):
    """The trainer flags after '--' as a validated TrainConfig (folders not looked at)."""
    from kubejax.trainer.config import from_args

    cfg = from_args(["--data-dir", "-", "--output-dir", "-", *args.trainer_args])
    if getattr(args, "device_memory", ""):
        cfg.device_memory = args.device_memory
    return cfg.validate(check_paths=False)


def _plan(args) -> int:
    from kubejax.launchers.common import check_mesh, devices_per_pod, place_workers
    from kubejax.trainer import plan

    replicas, pod, shape = place_workers(
        {},
        replicas=args.replicas,
        devices_per_worker=args.devices_per_worker,
        accelerator=args.accelerator,
        tpu_topology=args.tpu_topology,
        names=PLAN_FLAGS,
    )
    cfg = _trainer_config(args)
    if shape is not None:
        check_mesh(cfg, shape)
    per_pod, selector = devices_per_pod(pod), pod.get("node_selector")
    model_cfg = _model_config_of(args)
    fitting, devices = plan.fit_job(cfg, replicas, per_pod, selector, model_cfg)
    if fitting is None:  # no device memory given: the figures of the run as it asks
        fitting = plan.fit_memory(
            cfg, model_cfg or plan.model_config(cfg), cfg.num_labels or 5, devices, None,
            plan.platform_of(cfg, selector or {}, per_pod),
        )[1]  # fmt: skip
    if shape is not None:
        print(f"slice: {shape.describe()}, {shape.machine_type} hosts")
    print(f"batch: {fitting.describe()}")
    print(fitting.plan.describe())
    return 0


def _model_config_of(args):
    """The model's config from --model-config, or None (read from the model itself)."""
    if not getattr(args, "model_config", ""):
        return None
    from kubejax.trainer import plan

    return plan.model_config_file(args.model_config)


def _add_jaxjob(sub) -> None:
    p = sub.add_parser("jaxjob", help="render or run a trainer JAXJob (see render, launch)")
    jsub = p.add_subparsers(dest="jaxjob_command", required=True)

    r = jsub.add_parser(
        "render",
        help="print the JAXJob manifest as YAML",
        description="Print the manifest; trainer flags follow '--'.",
    )
    _job_options(r)
    r.set_defaults(func=_jaxjob_render, engine="jaxjob")
    run = jsub.add_parser(
        "run",
        help="run the JAXJob (--local: on this machine)",
        description="Run the trainer as a JAXJob; trainer flags follow '--'.",
    )
    _job_options(run)
    run.add_argument("--local", action="store_true", help="use the local backend")
    run.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait")
    run.add_argument("--log-dir", default=None, help="where worker logs go (local)")
    run.set_defaults(func=_jaxjob_run, engine=None, env_contract="jaxjob")


def _spec_from_args(args, unchecked_ok: bool = False):
    """The job of the options, refused (before anything is printed or submitted) when its
    accelerator settings contradict, its mesh does not fit the devices or its memory plan the
    device. `unchecked_ok` (a manifest rendered, nothing submitted): where this machine cannot
    read the model's config (`--model-config` not given), the plan is skipped, saying so in
    one line on stderr."""
    from kubejax.jobs.spec import JAXJobSpec, resources
    from kubejax.launchers.common import TRAINER_COMMAND, check_job, place_workers

    env = {}
    for pair in args.env:
        k, sep, v = pair.partition("=")
        if not sep:
            raise CliError(f"--env: {pair!r} is not NAME=VALUE")
        env[k] = v
    on_tpu = tpu.is_tpu(args.accelerator)
    # Off TPUs --tpus is a plain google.com/tpu limit; on one, the chips a host (place_workers).
    pod = {"resources": resources(args.cpu, args.memory, args.gpus, 0 if on_tpu else args.tpus)}
    replicas, pod, shape = place_workers(
        pod,
        replicas=args.replicas,
        devices_per_worker=args.tpus if on_tpu else 0,
        accelerator=args.accelerator,
        tpu_topology=args.tpu_topology,
        job=args.name,
        names=JOB_FLAGS,
    )
    spec = JAXJobSpec(
        name=args.name,
        image=tpu.image_for(args.accelerator, args.image),
        command=TRAINER_COMMAND,
        args=args.trainer_args,
        replicas=replicas,
        namespace=args.namespace,
        env=env,
        **pod,
        restart_policy=args.restart_policy,
        backoff_limit=args.backoff_limit,
        active_deadline_seconds=args.active_deadline,
        queue_name=args.queue_name,
        priority_class=args.priority_class,
    )
    from kubejax.trainer.plan import ModelConfigUnavailable

    try:
        check_job(_trainer_config(args), replicas, pod, shape, _model_config_of(args))
    except ModelConfigUnavailable as err:
        if not unchecked_ok:
            raise
        print(
            f"kubejax {args.command}: the memory plan was not checked ({err}); give "
            "--model-config PATH (its config.json) to check it",
            file=sys.stderr,
        )
    return spec


def _jaxjob_render(args) -> int:
    import yaml

    from kubejax.jobs.spec import build_manifest
    from kubejax.jobs.trainjob import build_trainjob_manifest

    spec = _spec_from_args(args, unchecked_ok=True)
    build = build_trainjob_manifest if args.engine == "trainjob" else build_manifest
    print(yaml.safe_dump(build(spec), sort_keys=False), end="")
    return 0


def _jaxjob_run(args) -> int:
    from kubejax.jobs.client import JAXJobClient, JobFailedError
    from kubejax.jobs.launch import run_job

    spec = _spec_from_args(args)
    # `jaxjob run` takes --local; `launch` names its engine.
    engine = args.engine or ("local" if args.local else "jaxjob")
    local = engine == "local" or (engine == "auto" and not in_cluster())
    if local:
        client = JAXJobClient(
            "local", log_root=args.log_dir, echo=True, env_contract=args.env_contract
        )
    else:
        client = JAXJobClient(engine, namespace=args.namespace)
    try:
        status = run_job(
            client,
            spec,
            timeout=args.timeout,
            delete="on_success",
            polling_interval=1.0 if local else None,
        )
    except JobFailedError as err:
        print(f"kubejax: {err}", file=sys.stderr)
        return 1
    print(f"kubejax: {client.kind} {spec.name} {status.state}")
    return 0


# ---------------------------------------------------------------------------------------------
# tune


def _add_tune(sub) -> None:
    from kubejax.tune import SweepConfig

    p = sub.add_parser(
        "tune",
        help="hyperparameter sweep whose trials are training jobs",
        description="Run an Optuna study; every trial trains as a job.",
    )
    p.add_argument("--data-dir", required=True, help="prepared dataset")
    p.add_argument("--model", required=True, help="model to fine-tune")
    p.add_argument("--space", required=True, help="JSON search space (or @file.json)")
    p.add_argument("--output-dir", required=True, help="trials, study.db, trials.json, report")
    p.add_argument("--hyperparameters", default="{}", help="JSON of fixed trainer settings")
    add_flags(p, SweepConfig, skip={"space", "storage", "study_name", "poll_seconds"})
    p.add_argument(
        "--replicas", type=int, default=1, help="workers per trial (0 on a TPU: the slice's hosts)"
    )
    _accelerator_options(p, "as the trials' hyperparameters and resources say")
    p.add_argument(
        "--backend",
        default="local",
        choices=BACKENDS,
        help="engine of the trials: local processes, trainjob, jaxjob, or kubernetes/auto "
        "(ask the cluster, TrainJob first)",
    )
    p.add_argument(
        "--image", default="", help="trial image (default: kubejax's for the accelerator)"
    )
    _queue_options(p)
    p.add_argument("--mlflow-tracking-uri", default="")
    p.add_argument("--mlflow-experiment", default="kubejax")
    p.set_defaults(func=_tune)


def _tune(args) -> int:
    from kubejax.launchers.sweep import sweep_with_jaxjobs
    from kubejax.tune import SweepConfig, write_report, write_trials

    space = args.space
    if space.startswith("@"):
        space = Path(space[1:]).read_text()
    try:
        fixed = json.loads(args.hyperparameters)
    except json.JSONDecodeError as err:
        raise CliError(f"--hyperparameters: not valid JSON ({err})") from err
    out = Path(args.output_dir)
    cfg = from_namespace(
        SweepConfig,
        args,
        space=space,
        storage=f"sqlite:///{out.resolve() / 'study.db'}",
        poll_seconds=1.0 if args.backend == "local" else 5.0,
    )
    out.mkdir(parents=True, exist_ok=True)
    result, _ = sweep_with_jaxjobs(
        cfg,
        data_dir=args.data_dir,
        trials_root=str(out / "trials"),
        hyperparameters={**fixed, "model": args.model},
        image=args.image,
        replicas=args.replicas,
        accelerator=args.accelerator,
        tpu_topology=args.tpu_topology,
        backend=args.backend,
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        mlflow_experiment=args.mlflow_experiment,
        queue_name=args.queue_name,
        priority_class=args.priority_class,
    )
    write_trials(result, out / "trials.json")
    write_report(result, cfg, out / "report.html")
    print(
        json.dumps(
            {
                "best_params": result.best_params,
                "best_value": result.best_value,
                "counts": result.counts,
                "trial_steps": result.trial_steps,
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------
# evaluate, compile, run, submit


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="test-set metrics of a trained model folder")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype: float32, bfloat16 or auto (bfloat16 where the device multiplies "
        "it natively, else float32)",
    )
    p.add_argument("--report", help="also write the HTML report here")
    p.set_defaults(func=_evaluate)


def _evaluate(args) -> int:
    from kubejax.evaluate import evaluate_model, summary, write_eval_report
    from kubejax.trainer.compile_cache import use_user_dir

    use_user_dir()
    result = evaluate_model(
        args.model_dir, args.data_dir, args.split, args.batch_size, dtype=args.dtype
    )
    if args.report:
        write_eval_report(result, args.report)
    print(json.dumps(summary(result)))
    return 0


def _add_compile(sub) -> None:
    p = sub.add_parser("compile", help="compile the pipelines and components to YAML")
    p.add_argument("--output-dir", default="compiled")
    p.set_defaults(func=_compile)


def _compile(args) -> int:
    from kubejax.compile import compile_all

    for path in compile_all(args.output_dir):
        print(path)
    return 0


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run the whole pipeline (--local: on this machine)",
        description="Run the Yelp pipeline under kfp.local with the local "
        "JAXJob backend and an sqlite MLflow store.",
    )
    p.add_argument(
        "--local",
        action="store_true",
        required=True,
        help="run on this machine (the only mode; use submit for a cluster)",
    )
    p.add_argument("--workdir", default="demo-run", help="data, workspace, MLflow store")
    p.add_argument(
        "--pipeline",
        default=None,
        choices=PIPELINE_NAMES,
        help="default: kubejax-llm with --profile llm, else kubejax-yelp",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a pipeline parameter (repeatable)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="budget: demo (the embedded synthetic data; the default without --param source), "
        "quick (the default for your own source: one epoch, max_length 128), full "
        "(three epochs, max_length 256, every row) or llm (the LLM pipeline with LoRA on a "
        "small embedded decoder with random weights; a real one: --param base_model=...)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print kfp.local's whole stream (executor input, every log line) to the terminal",
    )
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kubejax.local_run import run_local

    try:
        summary = run_local(
            args.workdir, args.param, args.pipeline, profile=args.profile, verbose=args.verbose
        )
    except ValueError as err:
        if str(err).startswith(("--param", "--profile")):
            raise CliError(str(err)) from err
        raise
    except RuntimeError as err:
        # kfp.local raises this when a task fails; the task's last lines were printed above.
        print(f"kubejax run: {err}", file=sys.stderr)
        print(f"kubejax run: the whole log: {Path(args.workdir) / 'logs'}", file=sys.stderr)
        return 1
    print("\n=== kubejax: evaluation summary ===")
    for key in ("accuracy", "macro_f1", "majority_baseline", "best_params", "trials", "model_uri"):
        if key in summary:
            print(f"{key:>18}: {summary[key]}")
    print(
        f"{'wall_s':>18}: {summary['wall_s']}  ("
        + ", ".join(
            f"{t['task']} {t['seconds']}" for t in summary["tasks"] if t["seconds"] is not None
        )
        + ")"
    )
    print(f"\nsummary: {Path(args.workdir) / 'summary.json'}")
    print(f"logs: {summary['logs']['pipeline']} and {summary['logs']['jobs']}/")
    print(f"look at it: mlflow ui --backend-store-uri {summary['mlflow_tracking_uri']}")
    return 0


def _add_submit(sub) -> None:
    p = sub.add_parser("submit", help="create a run of the compiled pipeline on a KFP server")
    p.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kfp.example")
    p.add_argument("--namespace", default=None, help="Kubeflow profile namespace")
    p.add_argument("--experiment", default="kubejax", help="KFP experiment name")
    p.add_argument("--pipeline", default="kubejax-yelp", choices=PIPELINE_NAMES)
    p.add_argument("--package", default=None, help="compiled YAML (default: compiled/NAME.yaml)")
    p.add_argument("--run-name", default=None)
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    p.set_defaults(func=_submit)


def _submit(args) -> int:
    from kubejax.submit import submit

    try:
        url = submit(
            args.host,
            args.pipeline,
            args.param,
            namespace=args.namespace,
            experiment=args.experiment,
            package=args.package,
            run_name=args.run_name,
        )
    except ValueError as err:
        raise CliError(str(err)) from err
    print(url)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command."""
    p = argparse.ArgumentParser(
        prog="kubejax",
        description="Fine-tune and tune JAX models, LLMs included, on Kubeflow (KFP v2 + TrainJob "
        "or JAXJob + MLflow).",
    )
    p.add_argument("--version", action="version", version=f"kubejax {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (
        _add_prepare,
        _add_render_and_launch,
        _add_jaxjob,
        _add_plan,
        _add_tune,
        _add_evaluate,
        _add_compile,
        _add_run,
        _add_submit,
    ):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kubejax` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, trainer_args = _split_trainer_args(argv)
    args = build_parser().parse_args(argv)
    args.trainer_args = trainer_args
    try:
        return args.func(args)
    except KubejaxError as err:
        print(f"kubejax {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

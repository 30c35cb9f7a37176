# ruff: noqa: E501 (the table keeps one case per line)
"""Bad input, table-driven: every case through the CLI, a component, the trainer, the sweep or
the data files, each answered with one line naming the field and what is allowed, a non-zero
exit, no traceback, and no partial output that looks complete."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kubejax import cli
from kubejax.errors import KubejaxError
from kubejax.trainer.train import main as trainer_main

#: A tiny decoder's config (`model scratch`), for the decoders' settings.
DECODER = json.dumps(
    {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 30522}
)  # fmt: skip
GOOD_CSV = "text,label\n" + "".join(
    f'"review number {i} was fine",{i % 5 + 1}\n' for i in range(40)
)


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# --- the inputs: (id, where it goes, a function of the fixtures giving its arguments, message)


def _prepare(data: str | bytes | None = None, *extra: str):
    """`kubejax prepare` on a data file holding `data` (None: no file)."""

    def build(f):
        source = f.tmp / "in" / "reviews.csv"
        if data is not None:
            _write(source, data)
        return ["prepare", "--source", str(source), "--tokenizer", str(f.model), "--output",
                str(f.out), "--test-fraction", "0.2", "--max-length", "64", *extra]  # fmt: skip

    return build


def _trainer(**overrides):
    def build(f):
        flags = {"model": f.model, "data_dir": f.data, "output_dir": f.out, "max_steps": 2}
        flags.update({k: v(f) if callable(v) else v for k, v in overrides.items()})
        return [a for k, v in flags.items() for a in ("--" + k.replace("_", "-"), str(v))]

    return build


def _tune(space, *extra):
    def build(f):
        return ["tune", "--data-dir", str(f.data), "--model", str(f.model), "--output-dir",
                str(f.out), "--space", space, "--backend", "local", *extra]  # fmt: skip

    return build


def _cli(*argv):
    return lambda f: [a(f) if callable(a) else a for a in argv]


SPACE = '{"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": true}}'

CASES = [
    # data files through `kubejax prepare`
    ("missing-file", "cli", _prepare(), r"source: .*reviews\.csv.* (does not exist|not found)"),
    ("empty-file", "cli", _prepare(""), r"source: .*(empty|no rows)"),
    ("header-only", "cli", _prepare("text,label\n"), r"(source|train): .*(empty|no rows)"),
    ("malformed-csv", "cli", _prepare('text,label\n"unclosed,1\nx,2\n' * 3), r"source: .*"),
    ("non-utf8", "cli", _prepare(b"text,label\n\xff\xfe bad,1\n" * 20), r"(?i)source: cannot read .*reviews.csv: .*utf-8.* decode byte 0xff"),
    ("label-out-of-range", "cli", _prepare(GOOD_CSV.replace(",5\n", ",9\n")), r"label_column: labels 1..9 miss \[5, 6, 7, 8\]"),
    ("label-above-num-labels", "cli", _prepare(GOOD_CSV.replace(",5\n", ",9\n"), "--num-labels", "5"), r"num_labels: .* outside 0..4"),
    ("label-not-numeric", "cli", _prepare(GOOD_CSV.replace(",3\n", ",three\n")), r"label_column: labels mix numbers .* and text \('three'\)"),
    ("no-text-column", "cli", _prepare(GOOD_CSV.replace("text,", "body,")), r"text_column: .*text"),
    ("no-label-column", "cli", _prepare(GOOD_CSV, "--label-column", "stars"), r"label_column: .*stars"),
    ("max-length-negative", "cli", _prepare(GOOD_CSV, "--max-length", "-5"), r"max_length: .*-5"),
    ("max-length-zero", "cli", _prepare(GOOD_CSV, "--max-length", "0"), r"max_length"),
    ("fraction-above-one", "cli", _prepare(GOOD_CSV, "--validation-fraction", "1.5"), r"validation_fraction"),
    ("samples-negative", "cli", _prepare(GOOD_CSV, "--max-train-samples", "-1"), r"max_train_samples"),
    ("num-labels-one", "cli", _prepare(GOOD_CSV, "--num-labels", "1"), r"num_labels"),
    ("max-length-above-positions", "cli", _prepare(GOOD_CSV, "--max-length", "256"), r"max_length: 256 exceeds the model's 128 positions"),
    ("max-length-not-int", "cli", _prepare(GOOD_CSV, "--max-length", "long"), r"max.length.*long"),
    ("label-mapping-not-json", "cli", _prepare(GOOD_CSV, "--label-mapping", "{1:"), r"label_mapping"),
    ("tokenizer-missing", "cli", lambda f: [*_prepare(GOOD_CSV)(f), "--tokenizer", str(f.tmp / "nope")], r"tokenizer"),
    ("output-is-a-file", "cli", lambda f: [*_prepare(GOOD_CSV)(f), "--output", str(_write(f.tmp / "file", "mine"))], r"output: .*file"),
    ("output-not-empty", "cli", lambda f: [*_prepare(GOOD_CSV)(f), "--output", str(_write(f.tmp / "full" / "keep.txt", "mine").parent)], r"output: .*not empty"),
    # the trainer
    ("lr-nan", "trainer", _trainer(learning_rate="nan"), r"learning_rate: must be a finite number"),
    ("lr-negative", "trainer", _trainer(learning_rate=-1), r"learning_rate"),
    ("batch-zero", "trainer", _trainer(global_batch_size=0), r"global_batch_size"),
    ("batch-not-int", "trainer", _trainer(global_batch_size="eight"), r"global.batch.size.*eight"),
    ("optimizer-unknown", "trainer", _trainer(optimizer="adamz"), r"optimizer.*adamz"),
    ("schedule-unknown", "trainer", _trainer(schedule="cosin"), r"schedule.*cosin"),
    ("warmup-above-one", "trainer", _trainer(warmup_ratio=2), r"warmup_ratio"),
    ("dropout-above-one", "trainer", _trainer(dropout=1.5), r"dropout"),
    ("data-dir-missing", "trainer", _trainer(data_dir=lambda f: f.tmp / "nodata"), r"data_dir"),
    ("data-dir-not-prepared", "trainer", _trainer(data_dir=lambda f: f.tmp), r"data_dir: .*not a prepared dataset"),
    ("model-missing", "trainer", _trainer(model=lambda f: f.tmp / "nomodel"), r"model"),
    ("mlflow-tags-not-json", "trainer", _trainer(mlflow_tags="{x"), r"mlflow_tags"),
    ("attention-unknown", "trainer", _trainer(attention="flash"), r"attention: 'flash' is not one of auto, xla, chunked, splash, cudnn"),
    ("attention-splash-off-a-tpu", "trainer", _trainer(model="scratch", scratch_config=DECODER, tokenizer=lambda f: f.model, attention="splash"), r"attention: splash runs on TPUs only, and this is a cpu; use auto, xla or chunked"),
    ("attention-cudnn-without-a-gpu", "trainer", _trainer(model="scratch", scratch_config=DECODER, tokenizer=lambda f: f.model, attention="cudnn"), r"attention: cudnn runs on NVIDIA GPUs only"),
    ("attention-block-not-dividing", "trainer", _trainer(model="scratch", scratch_config=DECODER, tokenizer=lambda f: f.model, attention="chunked", attention_block=48, max_length=64), r"attention_block: 48 does not divide max_length 64"),
    ("attention-splash-on-bert", "trainer", _trainer(attention="splash"), r"attention: splash applies to decoder models"),
    ("grad-accum-not-dividing", "trainer", _trainer(global_batch_size=8, grad_accum_steps=3), r"grad_accum_steps: 3 does not divide global_batch_size 8 \(a count of micro-batches dividing it, or auto\)"),
    ("grad-accum-not-a-count", "trainer", _trainer(grad_accum_steps="two"), r"grad_accum_steps: 'two' is neither a count of micro-batches nor auto"),
    ("grad-accum-not-dividing-a-device-share", "cli", _cli("render", "--replicas", "2", "--", "--model", "m", "--global-batch-size", "8", "--grad-accum-steps", "8"), r"grad_accum_steps: 8 does not divide the per-device batch of 4 \(global_batch_size 8 over 2 devices\); use 1, 2, 4 or auto"),
    ("remat-unknown", "trainer", _trainer(remat="some"), r"remat: 'some' is not one of none, minimal, full, auto"),
    ("remat-on-bert", "trainer", _trainer(remat="full"), r"remat: 'full' applies to decoder models; BERT trains without"),
    ("output-under-a-file", "trainer", _trainer(output_dir=lambda f: _write(f.tmp / "f", "mine") / "out"), r"output_dir"),
    # the sweep
    ("space-not-json", "cli", _tune("{learning_rate"), r"space"),
    ("space-unknown-type", "cli", _tune('{"lr": {"type": "cube"}}'), r"type.*cube"),
    ("space-low-above-high", "cli", _tune('{"learning_rate": {"type": "float", "low": 1, "high": 0}}'), r"low"),
    ("space-unknown-setting", "cli", _tune('{"learnin_rate": {"type": "float", "low": 0, "high": 1}}'), r"learnin_rate"),
    ("space-choices-not-list", "cli", _tune('{"optimizer": {"type": "categorical", "choices": "adamw"}}'), r"choices"),
    ("algorithm-unknown", "cli", _tune(SPACE, "--algorithm", "bayes"), r"algorithm.*bayes"),
    ("pruner-unknown", "cli", _tune(SPACE, "--pruner", "halving"), r"pruner.*halving"),
    ("parallelism-zero", "cli", _tune(SPACE, "--parallelism", "0"), r"parallelism"),
    ("max-trials-negative", "cli", _tune(SPACE, "--max-trials", "-3"), r"max_trials"),
    ("direction-unknown", "cli", _tune(SPACE, "--direction", "up"), r"direction.*up"),
    ("hyperparameters-wrong-type", "cli", _tune(SPACE, "--hyperparameters", '{"max_steps": "many"}'), r"max.steps.*many"),
    ("engine-unknown", "cli", _tune(SPACE, "--backend", "slurm"), r"backend.*slurm"),
    # other commands
    ("run-param-wrong-json", "cli", _cli("run", "--local", "--workdir", lambda f: str(f.out), "--param", "train_hyperparameters=[1,"), r"train_hyperparameters"),
    ("run-param-unknown", "cli", _cli("run", "--local", "--workdir", lambda f: str(f.out), "--param", "epochs=3"), r"epochs"),
    ("run-param-wrong-type", "cli", _cli("run", "--local", "--workdir", lambda f: str(f.out), "--param", "replicas=two"), r"replicas.*two"),
    ("run-profile-unknown", "cli", _cli("run", "--local", "--workdir", lambda f: str(f.out), "--profile", "huge"), r"profile.*huge"),
    ("evaluate-model-missing", "cli", _cli("evaluate", "--model-dir", lambda f: str(f.tmp / "nomodel"), "--data-dir", lambda f: str(f.data)), r"model"),
    ("evaluate-split-unknown", "cli", _cli("evaluate", "--model-dir", lambda f: str(f.trained), "--data-dir", lambda f: str(f.data), "--split", "dev"), r"split: 'dev' is not a split of .* \(it has test, train, validation\)"),
    ("evaluate-dtype-unknown", "cli", _cli("evaluate", "--model-dir", lambda f: str(f.trained), "--data-dir", lambda f: str(f.data), "--dtype", "float16"), r"dtype: 'float16' is not one of float32, bfloat16"),
    # TPU slices (kubejax.tpu's table), before any manifest or job
    ("tpu-type-unknown", "cli", _cli("plan", "--accelerator", "tpu-v9-slice", "--", "--model", "m"), r"--accelerator: invalid choice: 'tpu-v9-slice' \(choose from 'cpu', 'nvidia', 'tpu-v5-lite-podslice'"),
    ("tpu-topology-unknown", "cli", _cli("render", "--accelerator", "tpu-v5-lite-podslice", "--tpu-topology", "3x3", "--", "--model", "m"), r"--tpu-topology: '3x3' is not a tpu-v5-lite-podslice slice; one of 1x1, 2x2, 2x4, 4x4"),
    ("tpu-chips-per-host", "cli", _cli("render", "--accelerator", "tpu-v5-lite-podslice", "--tpu-topology", "4x4", "--tpus", "8", "--", "--model", "m"), r"--tpus: a tpu-v5-lite-podslice 4x4 slice has 4 chips on each host"),
    ("tpu-with-gpus", "cli", _cli("launch", "--engine", "local", "--accelerator", "tpu-v6e-slice", "--tpu-topology", "2x4", "--gpus", "1", "--", "--model", "m"), r"--gpus: accelerator tpu-v6e-slice takes no GPUs"),
    ("tpu-workers-contradict", "cli", _cli("render", "--engine", "jaxjob", "--accelerator", "tpu-v5p-slice", "--tpu-topology", "2x2x2", "--replicas", "3", "--", "--model", "m"), r"--replicas: 3 workers contradict the tpu-v5p-slice 2x2x2 \(8 chips: 2 hosts × 4\) slice"),
    ("tpu-mesh-not-the-slice", "cli", _cli("plan", "--accelerator", "tpu-v5-lite-podslice", "--tpu-topology", "4x4", "--", "--model", "m", "--mesh", "fsdp=3"), r"mesh: fsdp=3 makes 3 devices, but the job has 16 .*; the slice is tpu-v5-lite-podslice 4x4 \(16 chips: 4 hosts × 4\)"),
    # components, called as KFP calls them
    ("component-train-hyperparameters", "component", "train", r"hyperparameters: .*learning.rate.*fast"),
    ("component-train-backend", "component", "train-backend", r"backend.*slurm"),
    ("component-train-tpu-topology", "component", "train-tpu", r"^tpu_topology: '5x5' is not a tpu-v5-lite-podslice slice; one of 1x1"),
    ("component-tune-space", "component", "tune", r"search_space"),
    ("component-evaluate-split", "component", "evaluate", r"split.*dev"),
    ("component-prepare-max-length", "component", "prepare", r"max_length"),
]  # fmt: skip


def _artifact(path: Path):
    return SimpleNamespace(path=str(path), uri=str(path), metadata={})


def _component_call(which: str, f):
    """Call the component's function with artifacts as KFP hands them over."""
    import importlib

    evaluate, prepare, train, tune = (
        importlib.import_module(f"components.{m}") for m in ("evaluate", "prepare", "train", "tune")
    )

    out = f.out
    if which.startswith("train"):
        hp = {"learning_rate": "fast"} if which == "train" else {}
        backend = "slurm" if which == "train-backend" else "local"
        tpu = {"accelerator": "tpu-v5-lite-podslice", "tpu_topology": "5x5"}
        return lambda: train.train.python_func(
            dataset=_artifact(f.data), model=_artifact(out / "model"),
            metrics=SimpleNamespace(log_metric=lambda *a: None), report=_artifact(out / "r.html"),
            base_model=str(f.model), hyperparameters=hp, backend=backend,
            **(tpu if which == "train-tpu" else {}),
        )  # fmt: skip
    if which == "tune":
        return lambda: tune.tune_sweep.python_func(
            dataset=_artifact(f.data), trials=_artifact(out / "trials"),
            report=_artifact(out / "r.html"), summary=_artifact(out / "s.md"),
            metrics=SimpleNamespace(log_metric=lambda *a: None),
            base_model=str(f.model), search_space='{"learning_rate": {"type": "int"}}',
            backend="local",
        )  # fmt: skip
    if which == "evaluate":
        return lambda: evaluate.evaluate.python_func(
            model=_artifact(f.trained), dataset=_artifact(f.data), split="dev",
            metrics=SimpleNamespace(log_metric=lambda *a: None),
            confusion_matrix=SimpleNamespace(log_confusion_matrix=lambda *a: None),
            report=_artifact(out / "r.html"), mlflow_model=_artifact(out / "m.json"),
        )  # fmt: skip
    return lambda: prepare.prepare_yelp.python_func(
        dataset=_artifact(out / "dataset"), report=_artifact(out / "r.html"),
        source=str(_write(f.tmp / "in" / "r.csv", GOOD_CSV)), tokenizer=str(f.model),
        max_length=-1,
    )  # fmt: skip


def test_the_table_holds_forty_cases_or_more():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case", "where", "build", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    case, where, build, message, tmp_path, capsys, tiny_model_dir, prepared, trained_tiny
):
    f = SimpleNamespace(
        tmp=tmp_path,
        model=tiny_model_dir,
        trained=trained_tiny / "model",
        data=prepared,
        out=tmp_path / "out",
    )
    if where == "component":
        with pytest.raises((KubejaxError, ValueError)) as info:
            _component_call(build, f)()
        text, code = str(info.value), 2
    else:
        run = cli.main if where == "cli" else trainer_main
        try:
            code = run(build(f))
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
        captured = capsys.readouterr()
        text = captured.err
        assert "Traceback" not in captured.err + captured.out
        assert len([line for line in text.splitlines() if "error" in line]) == 1, text
    assert code == 2, text
    assert re.search(message, text), f"{case}: {text!r} does not match {message!r}"
    # Nothing that looks like a finished result was written.
    for done in ("metadata.json", "metrics.json", "model", "best_params.json", "summary.json"):
        assert not list(f.out.rglob(done)) if f.out.exists() else True, done


def test_paths_with_spaces_and_unicode_are_accepted(tmp_path, tiny_model_dir):
    source = _write(tmp_path / "my reviews" / "été ünïcode.csv", GOOD_CSV)
    out = tmp_path / "dossier préparé" / "data set"
    args = ["prepare", "--source", str(source), "--tokenizer", str(tiny_model_dir)]
    assert (
        cli.main([*args, "--output", str(out), "--test-fraction", "0.2", "--max-length", "64"]) == 0
    )
    assert json.loads((out / "metadata.json").read_text())["splits"]["train"]["rows"] > 0


@pytest.mark.slow
def test_a_ten_megabyte_review_is_truncated_not_refused(tmp_path, tiny_model_dir):
    huge = "great food " * (10 * 2**20 // 11)
    source = _write(tmp_path / "in.csv", GOOD_CSV + f'"{huge}",4\n')
    out = tmp_path / "data"
    args = ["prepare", "--source", str(source), "--tokenizer", str(tiny_model_dir)]
    assert (
        cli.main([*args, "--output", str(out), "--test-fraction", "0.2", "--max-length", "64"]) == 0
    )
    splits = json.loads((out / "metadata.json").read_text())["splits"]
    assert max(s["length_max"] for s in splits.values()) == 64
    assert sum(s["rows"] for s in splits.values()) == 41

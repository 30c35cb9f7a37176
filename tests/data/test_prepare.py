"""Data preparation: every source format, splits and caps, label mappings, the report, and
every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest

from kubejax.cli import main as cli_main
from kubejax.data.dataset import TokenizedSplit, load_split, packed_eval_batches
from kubejax.data.prepare import PrepareConfig, PrepareError, prepare_yelp, write_report
from kubejax.data.synthetic import generate_reviews
from tests.helpers import assert_self_contained_report


def _frame(n=200, seed=0, label_offset=1) -> pd.DataFrame:
    stars, texts = generate_reviews(n, seed)
    return pd.DataFrame({"label": stars - 1 + label_offset, "text": texts})


def _cfg(tok: Path, source, **kw) -> PrepareConfig:
    return PrepareConfig(tokenizer=str(tok), source=str(source), max_length=32, **kw)


def _write(df: pd.DataFrame, path: Path) -> Path:
    fmt = path.suffix
    if fmt == ".csv":
        df.to_csv(path, index=False)
    elif fmt == ".tsv":
        df.to_csv(path, sep="\t", index=False)
    elif fmt == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    elif fmt == ".json":
        df.to_json(path, orient="records")
    elif fmt == ".parquet":
        df.to_parquet(path)
    return path


def load_split_like(lengths: list[int]) -> TokenizedSplit:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedSplit(np.ones(offsets[-1], np.int32), offsets, np.zeros(len(lengths), np.int32))


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl", ".parquet"])
def test_each_file_format(tmp_path, minilm_dir, suffix):
    src = _write(_frame(), tmp_path / f"reviews{suffix}")
    meta = prepare_yelp(_cfg(minilm_dir, src), tmp_path / "out", progress=False)
    assert meta["num_labels"] == 5
    assert sum(s["rows"] for s in meta["splits"].values()) == 200
    assert meta["label_names"] == ["1", "2", "3", "4", "5"]
    train = load_split(tmp_path / "out", "train")
    assert train.labels.min() == 0 and train.labels.max() == 4
    assert (train.lengths <= 32).all()


def test_a_split_of_several_shards_reads_as_datasets_reads_it(tmp_path):
    rows = {"input_ids": [[101, *range(7, 7 + n), 102] for n in range(50)], "label": [1, 2] * 25}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "train"), num_shards=3)
    split = load_split(tmp_path, "train")
    ds = datasets.load_from_disk(str(tmp_path / "train"))
    assert split.labels.tolist() == ds["label"]
    assert split.lengths.tolist() == [len(r) for r in ds["input_ids"]]
    assert split.values[split.offsets[49] : split.offsets[50]].tolist() == ds[49]["input_ids"]


@pytest.mark.parametrize(
    "rows, processes, devices, sizes",
    [(75, 1, 1, [32, 32, 16]), (75, 4, 1, [32, 32, 16]), (65, 1, 1, [32, 32, 1]),
     (65, 2, 1, [32, 32, 2]), (65, 4, 1, [32, 32, 4]), (64, 2, 1, [32, 32]),
     # Several devices a process (a multi-GPU worker): a row for each device at least.
     (65, 1, 2, [32, 32, 2]), (65, 2, 4, [32, 32, 8]), (67, 1, 4, [32, 32, 4]),
     (73, 2, 2, [32, 32, 16])],
)  # fmt: skip
def test_the_last_evaluation_batch_is_padded_to_a_power_of_two_only(
    rows, processes, devices, sizes
):
    split = load_split_like(lengths=[5] * (rows - 5) + [9] * 5)
    per_process = [  # pack_length under every length: one review a row
        list(packed_eval_batches(split, batch_size=32, process_index=p, process_count=processes,
                                 local_devices=devices, bucket_multiple=8, max_length=16,
                                 pack_length=4))
        for p in range(processes)
    ]  # fmt: skip
    assert [sum(len(b[i]["weights"]) for b in per_process) for i in range(len(sizes))] == sizes
    real = np.concatenate([b["rows"][b["weights"] > 0] for bs in per_process for b in bs])
    assert sorted(real.tolist()) == list(range(rows))  # every row once, padding weighted 0


def test_zhang_csv_layout_folder(tmp_path, minilm_dir, yelp_dir):
    first = (yelp_dir / "train.csv").read_text().splitlines()[0]
    assert first.startswith('"') and "\\n" not in first[:3]
    meta = prepare_yelp(_cfg(minilm_dir, yelp_dir), tmp_path / "out", progress=False)
    assert meta["splits"]["test"]["rows"] == 300  # test.csv is the test split
    assert meta["splits"]["train"]["rows"] + meta["splits"]["validation"]["rows"] == 1500
    test = load_split(tmp_path / "out", "test", with_text=True)
    assert not any("\\n" in t for t in test.texts)  # escaped newlines are unescaped
    assert any("\n" in t for t in test.texts)


def test_headerless_three_column_layout(tmp_path, minilm_dir):
    src = tmp_path / "amazon.csv"
    src.write_text('"2","Great","Loved it\\nso much"\n"1","Bad","Awful service"\n' * 20)
    meta = prepare_yelp(_cfg(minilm_dir, src), tmp_path / "out", progress=False)
    assert meta["num_labels"] == 2


@pytest.mark.slow
def test_stratified_validation_and_caps(tmp_path, minilm_dir):
    src = _write(_frame(1000), tmp_path / "r.parquet")
    meta = prepare_yelp(
        _cfg(
            minilm_dir, src, max_train_samples=300, max_validation_samples=50, max_test_samples=40
        ),
        tmp_path / "out",
        progress=False,
    )
    s = meta["splits"]
    assert (s["train"]["rows"], s["validation"]["rows"], s["test"]["rows"]) == (300, 50, 40)
    for split in s.values():
        counts = np.array(split["class_counts"])
        shares = counts / counts.sum()
        assert np.abs(shares - 0.2).max() < 0.06  # the classes are balanced in the source


def test_split_spec_slices(tmp_path, minilm_dir):
    folder = tmp_path / "src"
    folder.mkdir()
    _write(_frame(400), folder / "train.csv")
    _write(_frame(100, seed=1), folder / "test.csv")
    meta = prepare_yelp(
        _cfg(minilm_dir, folder, train_split="train[:50%]", test_split="test[10:30]"),
        tmp_path / "out",
        progress=False,
    )
    assert meta["splits"]["test"]["rows"] == 20
    assert meta["splits"]["train"]["rows"] + meta["splits"]["validation"]["rows"] == 200


LABELS = [
    ("stars 1..5 → 0..4", [1, 2, 3, 4, 5], "auto", {"1": 0, "5": 4}, ["1", "2", "3", "4", "5"]),
    ("0-based ids stay", [0, 1, 2], "auto", {"0": 0, "2": 2}, ["0", "1", "2"]),
    (
        "strings → sorted ids",
        ["pos", "neg", "mid"],
        "auto",
        {"mid": 0, "neg": 1, "pos": 2},
        ["mid", "neg", "pos"],
    ),
    (
        "explicit mapping",
        ["pos", "neg"],
        '{"neg": 0, "pos": 1}',
        {"neg": 0, "pos": 1},
        ["neg", "pos"],
    ),
]


@pytest.mark.parametrize(
    ("name", "raw", "mapping", "expected", "names"), LABELS, ids=[c[0] for c in LABELS]
)
def test_label_mappings(tmp_path, minilm_dir, name, raw, mapping, expected, names):
    _, texts = generate_reviews(60 * len(raw))
    df = pd.DataFrame({"text": texts, "label": [raw[i % len(raw)] for i in range(len(texts))]})
    src = _write(df, tmp_path / "r.jsonl")
    meta = prepare_yelp(
        _cfg(minilm_dir, src, label_mapping=mapping), tmp_path / "o", progress=False
    )
    assert {k: meta["label_mapping"][k] for k in expected} == expected
    assert meta["label_names"] == names


def test_cleaning_counts_drops(tmp_path, minilm_dir):
    df = _frame(100)
    df.loc[:4, "text"] = "   "
    df.loc[5:9, "text"] = df.loc[10, "text"]
    src = _write(df, tmp_path / "r.csv")
    meta = prepare_yelp(_cfg(minilm_dir, src, deduplicate=True), tmp_path / "o", progress=False)
    assert meta["dropped"] == {"empty_text": 5, "duplicate_text": 5}


def test_metadata_and_report(tmp_path, minilm_dir, prepared):
    meta = json.loads((prepared / "metadata.json").read_text())
    train = meta["splits"]["train"]
    assert {"p50", "p90", "p99"} <= set(train["length_percentiles"])
    assert 0 < train["truncation_rate"] <= 1
    assert meta["source"] and meta["tokenizer"]
    assert meta["tokenizer_engine"].startswith("nanotoken ")  # MiniLM's WordPiece
    ds = datasets.load_from_disk(str(prepared))
    assert set(ds["train"].column_names) == {"input_ids", "attention_mask", "label", "length"}
    assert "text" in ds["test"].column_names
    write_report(meta, tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert meta["tokenizer_engine"] in html
    assert "Class balance" in html and "Token lengths (train split)" in html
    assert f"max_length {meta['max_length']}" in html and "length buckets (32)" in html
    # The real-token share of the training rows, with and without packing.
    share = train["real_token_share"]
    assert 0 < share["padded"] <= share["bucketed"] <= 1 and share["packed"] > share["padded"]
    assert "reviews packed in rows of max_length (packing)" in html
    assert f"{share['packed']:.1%}" in html and f"{share['padded']:.1%}" in html
    assert_self_contained_report(html, figures=2)


def test_the_real_token_share_with_and_without_packing():
    from kubejax.data.dataset import real_token_share

    # Reviews of 10 and 30 tokens at max_length 40: each padded to 40 fills half the tokens;
    # buckets of 32 pad them to 32 each (40/64); packed first-fit in shuffled order, nearly
    # every row takes one of each (a row of 10s leaves no room for a 30).
    lengths = np.array([10, 30] * 50)
    assert real_token_share(lengths, 40, packed=False) == 0.5
    assert real_token_share(lengths, 40, packed=False, bucket_multiple=32) == 40 / 64
    assert 0.95 < real_token_share(lengths, 40, packed=True) < 1.0
    # Longer reviews count as truncated to max_length.
    assert real_token_share(np.array([50, 40]), 40, packed=False) == 1.0


def test_truncation_equals_the_tokenizers_own(minilm_dir):
    from tokenizers import Tokenizer

    from kubejax.data.tokenizer import load_tokenizer, tokenize

    _, texts = generate_reviews(100, seed=3)
    values, offsets, truncated = tokenize(texts, load_tokenizer(str(minilm_dir), 48))
    ref = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    ref.no_padding()
    ref.enable_truncation(48)
    for i, enc in enumerate(ref.encode_batch(texts)):
        assert values[offsets[i] : offsets[i + 1]].tolist() == enc.ids
    assert truncated.any()


def _bad(tmp_path, minilm_dir, **kw):
    source = kw.pop("source", None) or _write(_frame(), tmp_path / "r.csv")
    return lambda: prepare_yelp(_cfg(minilm_dir, source, **kw), tmp_path / "out", progress=False)


BAD = [
    ("hub id offline", {"source": "nobody/no-such-dataset"}, "local file or folder"),
    ("missing column", {"text_column": "review"}, "its columns are"),
    ("labels out of range", {"num_labels": 3}, "num_labels: "),
    ("malformed split spec", {"train_split": "train[:abc]"}, "train_split:"),
    ("max_length above positions", {"max_length": 4096}, "max_length: 4096 exceeds"),
    ("unknown extension", {"source": "reviews.xlsx"}, "source:"),
    ("missing file", {"source": "/nonexistent/reviews.csv"}, "does not exist"),
    ("bad label mapping", {"label_mapping": "{not json"}, "label_mapping:"),
]


@pytest.mark.parametrize(("name", "kw", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_named_and_leaves_nothing(tmp_path, minilm_dir, name, kw, message):
    if kw.get("max_length"):
        run = lambda: prepare_yelp(  # noqa: E731
            PrepareConfig(
                tokenizer=str(minilm_dir),
                source=str(_write(_frame(), tmp_path / "r.csv")),
                max_length=kw["max_length"],
            ),
            tmp_path / "out",
            progress=False,
        )
    else:
        run = _bad(tmp_path, minilm_dir, **kw)
    with pytest.raises(PrepareError, match=message.replace("[", r"\[")):
        run()
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_missing_labels_and_nothing_left(tmp_path, minilm_dir):
    df = _frame(50)
    df.loc[3, "label"] = None
    with pytest.raises(PrepareError, match="label_column: 1 rows have no label"):
        _bad(tmp_path, minilm_dir, source=_write(df, tmp_path / "m.csv"))()
    df = _frame(50)
    df["text"] = " "
    with pytest.raises(PrepareError, match="nothing is left"):
        _bad(tmp_path, minilm_dir, source=_write(df, tmp_path / "e.csv"))()
    assert not (tmp_path / "out").exists()


def test_unreadable_file(tmp_path, minilm_dir):
    src = tmp_path / "broken.parquet"
    src.write_bytes(b"not parquet at all")
    with pytest.raises(PrepareError, match="cannot read"):
        _bad(tmp_path, minilm_dir, source=src)()


@pytest.mark.slow
def test_cli_prepare_and_its_errors(tmp_path, minilm_dir, yelp_dir, capsys):
    out = tmp_path / "cli-out"
    code = cli_main(
        [
            "prepare",
            "--tokenizer",
            str(minilm_dir),
            "--source",
            str(yelp_dir),
            "--output",
            str(out),
            "--max-length",
            "32",
            "--report",
            str(tmp_path / "r.html"),
        ]
    )
    assert code == 0 and (out / "metadata.json").is_file() and (tmp_path / "r.html").is_file()
    with_header = _write(_frame(), tmp_path / "h.csv")
    code = cli_main(
        [
            "prepare",
            "--tokenizer",
            str(minilm_dir),
            "--source",
            str(with_header),
            "--output",
            str(tmp_path / "x"),
            "--label-column",
            "stars",
        ]
    )
    assert code == 2
    assert "label_column" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_output_that_cannot_take_the_dataset_is_refused_before_any_work(
    tmp_path, minilm_dir, yelp_dir, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    owned = tmp_path / "owned"
    owned.mkdir()
    (owned / "notes.txt").write_text("mine too")
    cases = [
        (blocker, f"output: {blocker} is a file, not a folder"),
        (blocker / "data", f"output: cannot write in {blocker}"),
        (owned, f"output: {owned} exists and is not empty"),
    ]
    for output, expected in cases:
        argv = ["prepare", "--tokenizer", str(minilm_dir), "--source", str(yelp_dir)]
        assert cli_main([*argv, "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert blocker.read_text() == "mine" and (owned / "notes.txt").read_text() == "mine too"


def test_a_model_folder_without_tokenizer_files_says_which_are_missing(tmp_path, yelp_dir, capsys):
    folder = tmp_path / "model-without-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    argv = ["prepare", "--tokenizer", str(folder), "--source", str(yelp_dir)]
    assert cli_main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has neither tokenizer.json nor vocab.txt" in err
    assert not (tmp_path / "out").exists()

"""Yelp reviews (Hugging Face hub or the user's files) into the tokenized dataset.

The on-disk format, read by the trainer and evaluation (`kubejax.data.dataset`):

    <out>/dataset_dict.json, <out>/{train,validation,test}/   datasets.DatasetDict.save_to_disk
        input_ids       list<int32>   token ids, [CLS] … [SEP], truncated to max_length, unpadded
        attention_mask  list<int8>    ones, one per token (the trainer pads per length bucket)
        label           int64         0 … num_labels-1
        length          int32         number of tokens
        text            string        test split only: the cleaned review, for predictions
    <out>/metadata.json   label names and mapping, rows per split, class balance, token-length
                          percentiles, truncation rate, rows dropped by each cleaning rule,
                          tokenizer and the engine used, max_length, source and revision
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kubejax import report
from kubejax.data import dataset, prompts
from kubejax.data.dataset import DEFAULT_BUCKET_MULTIPLE, METADATA_FILE
from kubejax.data.prompts import DEFAULT_PROMPT_TEMPLATE
from kubejax.data.tokenizer import TokenizerError, load_tokenizer, tokenize
from kubejax.errors import KubejaxError
from kubejax.flags import setting as _f

FORMATS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
SPLITS = ("train", "validation", "test")
_SPLIT_RE = re.compile(r"^([A-Za-z_][\w.-]*)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?$")


class PrepareError(KubejaxError, ValueError):
    """Bad input to data preparation; the message names the setting."""


@dataclass
class PrepareConfig:
    """What `prepare_yelp` reads and how it tokenizes."""

    tokenizer: str = field(metadata={"help": "model folder or hub id whose fast tokenizer is used"})
    source: str = _f("Yelp/yelp_review_full", "hub dataset id, a file, a folder, or an fsspec URI")
    revision: str | None = _f(None, "hub revision (branch, tag or commit)")
    train_split: str = _f("train", 'split spec, e.g. "train" or "train[:1%]"')
    validation_split: str = _f("", "split spec of the validation data; empty: carved out of train")
    test_split: str = _f("test", "split spec of the test data (a single-file source: carved out)")
    text_column: str = _f("text", "column holding the review text")
    label_column: str = _f("label", "column holding the label")
    label_mapping: str = _f("auto", "auto | a JSON object {raw label: id}")
    num_labels: int = _f(0, "0: inferred; else labels must lie in 0..num_labels-1 after mapping")
    max_length: int = _f(256, "truncation length in tokens, [CLS] and [SEP] included")
    task: str = _f(
        "classification",
        "classification (the review's tokens) or causal-lm (decoders: the review in "
        "prompt_template, each label's name as its answer)",
    )
    prompt_template: str = _f(
        DEFAULT_PROMPT_TEMPLATE,
        "causal-lm: the prompt, with {review} where the review goes (empty: the default)",
    )
    validation_fraction: float = _f(0.1, "share of train carved out as validation")
    test_fraction: float = _f(0.1, "share carved out as test when the source has no test split")
    max_train_samples: int = _f(0, "stratified cap on train rows; 0: no cap")
    max_validation_samples: int = _f(0, "stratified cap on validation rows; 0: no cap")
    max_test_samples: int = _f(0, "stratified cap on test rows; 0: no cap")
    deduplicate: bool = _f(False, "drop repeated texts (first kept)")
    unescape_newlines: bool = _f(True, "the literal two characters \\n become newlines")
    seed: int = _f(0, "seed of the splits and caps")
    extra: dict = field(
        default_factory=dict,
        metadata={"help": "Python only (no flag): entries kept as is in the dataset's metadata"},
    )

    def __post_init__(self):
        self.tokenizer, self.source = str(self.tokenizer), str(self.source)
        for name in ("train_split", "test_split") + (
            ("validation_split",) if self.validation_split else ()
        ):
            if not _SPLIT_RE.match(getattr(self, name)):
                raise PrepareError(
                    f"{name}: {getattr(self, name)!r} is not a split spec "
                    "(NAME or NAME[START:END], START/END integers or percentages)"
                )
        for name in ("validation_fraction", "test_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise PrepareError(f"{name}: must be between 0 and 1, got {getattr(self, name)}")
        if self.max_length < 8:
            raise PrepareError(f"max_length: must be at least 8, got {self.max_length}")
        for name in ("max_train_samples", "max_validation_samples", "max_test_samples"):
            if getattr(self, name) < 0:
                raise PrepareError(f"{name}: must be 0 (no cap) or more, got {getattr(self, name)}")
        self.prompt_template = self.prompt_template or DEFAULT_PROMPT_TEMPLATE
        if self.task not in ("classification", "causal-lm"):
            raise PrepareError(f"task: {self.task!r} is not one of classification, causal-lm")
        if self.task == "causal-lm":
            try:
                prompts.check_template(self.prompt_template)
            except prompts.PromptError as err:
                raise PrepareError(str(err)) from err
        if self.num_labels < 0 or self.num_labels == 1:
            raise PrepareError(
                f"num_labels: must be 0 (from the data) or at least 2, got {self.num_labels}"
            )


def _parse_split(spec: str) -> tuple[str, str | None, str | None]:
    m = _SPLIT_RE.match(spec)
    assert m is not None  # validated in PrepareConfig
    return m.group(1), m.group(2), m.group(3)


def _slice(df: pd.DataFrame, start: str | None, end: str | None) -> pd.DataFrame:
    def pos(v):
        if v is None:
            return None
        return round(len(df) * int(v[:-1]) / 100) if v.endswith("%") else int(v)

    return df.iloc[pos(start) : pos(end)]


def _looks_local(source: str) -> bool:
    return (
        "://" in source
        or source.startswith((".", "/", "~"))
        or Path(source).suffix.lower() in FORMATS
        or os.path.exists(source)
    )


def _read_csv(path: str, sep: str, cfg: PrepareConfig) -> pd.DataFrame:
    import fsspec

    with fsspec.open(path, "r", encoding="utf-8", newline="") as f:
        first = next(csv.reader([f.readline()], delimiter=sep), [])
    zhang = len(first) in (2, 3) and first[0].strip().lstrip("-").isdigit()
    if not zhang:
        # A header row; missing columns are reported with the columns it has.
        return pd.read_csv(path, sep=sep, keep_default_na=False, dtype=str)
    # The Zhang et al. (2015) layout: no header, class first, then (title and) text.
    names = ["label", "text"] if len(first) == 2 else ["label", "title", "text"]
    df = pd.read_csv(path, sep=sep, header=None, names=names, keep_default_na=False, dtype=str)
    if len(first) == 3:
        df["text"] = df["title"].str.cat(df["text"], sep="\n")
    return df.rename(columns={"label": cfg.label_column, "text": cfg.text_column})


def read_file(path: str, cfg: PrepareConfig) -> pd.DataFrame:
    """One local or fsspec file as a DataFrame."""
    suffix = Path(path.split("?")[0]).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise PrepareError(f"source: {path} has extension {suffix!r}; allowed: {sorted(FORMATS)}")
    try:
        if fmt in ("csv", "tsv"):
            return _read_csv(path, "," if fmt == "csv" else "\t", cfg)
        if fmt == "parquet":
            return pd.read_parquet(path)
        try:
            return pd.read_json(path, lines=fmt == "jsonl", dtype=False)
        except ValueError:
            return pd.read_json(path, lines=True, dtype=False)
    except PrepareError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise PrepareError(f"source: cannot read {path}: {err}") from err


def _split_files(source: str) -> dict[str, str] | None:
    """Split name → file for a folder source; None for a single file."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(source)
    if not fs.exists(root):
        raise PrepareError(f"source: {source} does not exist")
    if not fs.isdir(root):
        return None
    prefix = source[: len(source) - len(root)] if source.endswith(root) else ""
    found = {}
    for entry in fs.ls(root, detail=False):
        p = Path(entry)
        if p.suffix.lower() in FORMATS:
            found.setdefault(p.stem, prefix + entry)
    if not found:
        raise PrepareError(f"source: folder {source} holds no {sorted(FORMATS)} files")
    return found


def load_source(cfg: PrepareConfig) -> tuple[dict[str, pd.DataFrame], list[str] | None]:
    """The source's splits as DataFrames (missing ones absent), and class names if it has any."""
    wanted = {"train": cfg.train_split, "test": cfg.test_split}
    if cfg.validation_split:
        wanted["validation"] = cfg.validation_split
    if _looks_local(cfg.source):
        files = _split_files(cfg.source)
        if files is None:
            return {"all": read_file(cfg.source, cfg)}, None
        out = {}
        for split, spec in wanted.items():
            name, start, end = _parse_split(spec)
            if name in files:
                out[split] = _slice(read_file(files[name], cfg), start, end)
            elif split == "train":
                raise PrepareError(
                    f"train_split: no file named {name}.* in {cfg.source}; "
                    f"there are {sorted(files)}"
                )
        return out, None
    return _load_hub(cfg, wanted)


def _load_hub(cfg: PrepareConfig, wanted: dict[str, str]):
    import datasets

    out, names = {}, None
    for split, spec in wanted.items():
        try:
            ds = datasets.load_dataset(cfg.source, revision=cfg.revision, split=spec)
        except ValueError as err:
            if split != "train" and "Unknown split" in str(err):
                continue  # carved out of train below
            raise PrepareError(f"{split}_split: {spec!r}: {err}") from err
        except Exception as err:  # hub/network errors come in many types
            raise PrepareError(
                f"source: cannot load hub dataset {cfg.source!r} ({type(err).__name__}: {err}). "
                "Without network access, pass a local file or folder (csv, tsv, json, jsonl, "
                "parquet) as source."
            ) from err
        feature = ds.features.get(cfg.label_column)
        if getattr(feature, "names", None):
            names = list(feature.names)
        out[split] = ds.to_pandas()
    return out, names


def _check_columns(frames: dict[str, pd.DataFrame], cfg: PrepareConfig) -> None:
    for split, df in frames.items():
        for setting, col in (("text_column", cfg.text_column), ("label_column", cfg.label_column)):
            if col not in df.columns:
                raise PrepareError(
                    f"{setting}: column {col!r} is not in the {split} data; "
                    f"its columns are {list(df.columns)}"
                )


def build_label_mapping(
    raw: pd.Series, cfg: PrepareConfig, class_names: list[str] | None
) -> tuple[dict[str, int], list[str]]:
    """Raw label (as text) → id, and the label names by id."""
    values = sorted({str(v) for v in raw})
    if cfg.label_mapping != "auto":
        try:
            mapping = {str(k): int(v) for k, v in json.loads(cfg.label_mapping).items()}
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as err:
            raise PrepareError(
                f"label_mapping: must be 'auto' or a JSON object of raw label to id, got "
                f"{cfg.label_mapping!r}"
            ) from err
        unknown = [v for v in values if v not in mapping]
        if unknown:
            raise PrepareError(f"label_mapping: labels {unknown[:10]} have no id in the mapping")
        names = [None] * (max(mapping.values()) + 1)
        for k, v in sorted(mapping.items(), key=lambda kv: kv[1]):
            names[v] = names[v] or k
        return mapping, [n if n is not None else str(i) for i, n in enumerate(names)]
    numeric = [v for v in values if re.fullmatch(r"-?\d+(\.0+)?", v)]
    if numeric and len(numeric) < len(values):
        text = [v for v in values if v not in numeric]
        raise PrepareError(
            f"label_column: labels mix numbers ({', '.join(numeric[:5])}) and text "
            f"({', '.join(repr(t) for t in text[:5])}); use one kind, or map them with "
            "label_mapping"
        )
    if numeric:
        ints = sorted({int(float(v)) for v in values})
        if ints[0] < 0:
            raise PrepareError(f"label_column: negative labels {ints[:5]}")
        gaps = sorted(set(range(ints[0], ints[-1] + 1)) - set(ints))
        if gaps and not cfg.num_labels and class_names is None:
            raise PrepareError(
                f"label_column: labels {ints[0]}..{ints[-1]} miss {gaps[:5]}, so "
                f"{ints[-1]} looks out of range; set num_labels (or label_mapping) if the "
                "classes are right"
            )
        # 1-based classes (stars 1..5) become 0-based; 0-based stay.
        offset = 1 if ints[0] == 1 and class_names is None else 0
        top = ints[-1] - offset
        mapping = {v: int(float(v)) - offset for v in values}
        if class_names is not None:
            names = class_names
        else:
            names = [str(i + offset) for i in range(top + 1)]
        return mapping, names
    return {v: i for i, v in enumerate(values)}, values


def _clean(df: pd.DataFrame, cfg: PrepareConfig, dropped: dict) -> pd.DataFrame:
    text = df[cfg.text_column].fillna("").astype(str)
    if cfg.unescape_newlines:
        text = text.str.replace("\\n", "\n", regex=False)
    missing = df[cfg.label_column].isna() | (df[cfg.label_column].astype(str).str.strip() == "")
    if missing.any():
        raise PrepareError(
            f"label_column: {int(missing.sum())} rows have no label (first at row "
            f"{int(np.flatnonzero(missing.to_numpy())[0])})"
        )
    out = pd.DataFrame({"text": text.str.strip(), "raw_label": df[cfg.label_column].astype(str)})
    empty = out["text"] == ""
    dropped["empty_text"] = dropped.get("empty_text", 0) + int(empty.sum())
    out = out[~empty]
    if cfg.deduplicate:
        dup = out.duplicated("text")
        dropped["duplicate_text"] = dropped.get("duplicate_text", 0) + int(dup.sum())
        out = out[~dup]
    return out.reset_index(drop=True)


def stratified_split(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (kept, carved) with `fraction` of every class carved out, at least one each."""
    carved = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        k = round(len(idx) * fraction) if len(idx) > 1 else 0
        carved.append(idx[: max(k, 1 if len(idx) > 1 else 0)])
    carved_idx = np.sort(np.concatenate(carved))
    kept = np.setdiff1d(np.arange(len(labels)), carved_idx)
    return kept, carved_idx


def stratified_cap(labels: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of exactly `cap` rows (when there are more), keeping class proportions
    (largest-remainder quotas per class)."""
    if cap <= 0 or cap >= len(labels):
        return np.arange(len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * cap / len(labels)
    take = np.floor(quota).astype(int)
    extra = np.argsort(-(quota - take), kind="stable")[: cap - take.sum()]
    take[extra] += 1
    picked = [
        rng.choice(np.flatnonzero(labels == c), size=k, replace=False)
        for c, k in zip(classes, take, strict=True)
    ]
    return np.sort(np.concatenate(picked))


def _arrow_table(values, offsets, labels, texts):
    import pyarrow as pa

    lengths = np.diff(offsets).astype(np.int32)
    cols = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values)),
        "attention_mask": pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), pa.array(np.ones(len(values), dtype=np.int8))
        ),
        "label": pa.array(labels.astype(np.int64)),
        "length": pa.array(lengths),
    }
    if texts is not None:
        cols["text"] = pa.array(texts, type=pa.string())
    return pa.table(cols)


def prepare_yelp(cfg: PrepareConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Read, clean, split and tokenize; write the dataset folder; return its metadata.

    The folder appears only when complete: it is built beside `out_dir` and renamed into place.
    Progress bars show on a terminal only (a pod's log gets none).
    """
    progress = progress and sys.stderr.isatty()
    check_output_dir(Path(out_dir))
    try:
        tok = load_tokenizer(cfg.tokenizer, cfg.max_length)
    except TokenizerError as err:
        raise PrepareError(str(err)) from err
    frames, class_names = load_source(cfg)
    _check_columns(frames, cfg)
    dropped: dict[str, int] = {}
    cleaned = {split: _clean(df, cfg, dropped) for split, df in frames.items()}
    for split, df in cleaned.items():
        _check_not_empty(df, split, dropped)
    mapping, label_names, num_labels = _assign_labels(cleaned, cfg, class_names)
    lm = _prompt_metadata(cfg, tok, label_names)
    splits = _split_and_cap(cleaned, cfg, dropped)
    tables, stats = {}, {}
    for split in SPLITS:
        tables[split], stats[split] = _tokenize_split(splits[split], split, tok, cfg, lm, progress)
        stats[split]["class_counts"] = np.bincount(
            splits[split]["label"].to_numpy(), minlength=num_labels
        ).tolist()
    metadata = {
        "format": "kubejax.tokenized.v1",
        "num_labels": num_labels,
        "label_names": label_names,
        "label_mapping": mapping,
        "splits": stats,
        "dropped": dropped,
        "tokenizer": cfg.tokenizer,
        "tokenizer_engine": tok.engine,
        "max_length": cfg.max_length,
        "source": cfg.source,
        "revision": cfg.revision,
        "task": cfg.task,
        **lm,
        "config": asdict(cfg),
    }
    _write_atomically(tables, metadata, Path(out_dir), progress)
    return metadata


def _check_not_empty(df: pd.DataFrame, split: str, dropped: dict) -> None:
    if len(df) == 0:
        raise PrepareError(
            f"source: nothing is left of the {split} data after cleaning "
            f"(dropped: {dropped or 'none'})"
        )


def _assign_labels(cleaned: dict, cfg: PrepareConfig, class_names) -> tuple[dict, list, int]:
    """Map every split's raw labels to ids in place; the mapping, names and label count."""
    raw = pd.concat([df["raw_label"] for df in cleaned.values()])
    mapping, label_names = build_label_mapping(raw, cfg, class_names)
    num_labels = cfg.num_labels or len(label_names)
    for split, df in cleaned.items():
        ids = df["raw_label"].map(mapping).to_numpy(dtype=np.int64)
        bad = (ids < 0) | (ids >= num_labels)
        if bad.any():
            raise PrepareError(
                f"num_labels: {split} has labels outside 0..{num_labels - 1} "
                f"(raw {sorted(set(df['raw_label'][bad]))[:5]})"
            )
        df["label"] = ids
    label_names = list(label_names) + [str(i) for i in range(len(label_names), num_labels)]
    return mapping, label_names, num_labels


def _split_and_cap(cleaned: dict, cfg: PrepareConfig, dropped: dict) -> dict[str, pd.DataFrame]:
    """Train, validation and test: carved out where the source lacks them (stratified), then
    capped to the max_*_samples settings keeping the class balance."""
    rng = np.random.default_rng(cfg.seed)
    cleaned = dict(cleaned)

    def carve(name: str, fraction: float, source: str) -> None:
        df = cleaned.pop(source)
        keep, part = stratified_split(df["label"].to_numpy(), fraction, rng)
        cleaned["train"], cleaned[name] = df.iloc[keep], df.iloc[part]

    if "all" in cleaned:
        carve("test", cfg.test_fraction, "all")
    if "validation" not in cleaned:
        carve("validation", cfg.validation_fraction, "train")
    if "test" not in cleaned:
        carve("test", cfg.test_fraction, "train")
    caps = {
        "train": cfg.max_train_samples,
        "validation": cfg.max_validation_samples,
        "test": cfg.max_test_samples,
    }
    out = {}
    for split in SPLITS:
        df = cleaned[split]
        df = df.iloc[stratified_cap(df["label"].to_numpy(), caps[split], rng)]
        _check_not_empty(df, split, dropped)
        out[split] = df.reset_index(drop=True)
    return out


def _prompt_metadata(cfg: PrepareConfig, tok, label_names: list[str]) -> dict:
    """causal-lm: the template and each label's answer tokens, checked (none for
    classification)."""
    if cfg.task != "causal-lm":
        return {}
    _check_decoder_tokenizer(cfg.tokenizer)
    try:
        answers = prompts.answer_ids(tok, label_names)
    except prompts.PromptError as err:
        raise PrepareError(str(err)) from err
    return {"prompt_template": cfg.prompt_template, "answers": answers}


def _check_decoder_tokenizer(tokenizer: str) -> None:
    """causal-lm needs a decoder: refused when the tokenizer's folder says it is an encoder."""
    config = Path(tokenizer).expanduser() / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type == "bert":
        raise PrepareError(
            f"task: causal-lm needs a decoder model's tokenizer; {tokenizer} is a {model_type} "
            "model (llama, mistral, qwen2, qwen3, gemma3_text do causal-lm)"
        )


def _tokenize_split(df: pd.DataFrame, split: str, tok, cfg: PrepareConfig, lm, progress: bool):
    """One split's Arrow table and its length statistics (texts kept for the test split);
    causal-lm rows are the reviews' prompts."""
    texts = df["text"].tolist()
    if lm:
        longest = max(len(a) for a in lm["answers"])
        try:
            values, offsets, truncated = prompts.encode_prompts(
                texts, tok, cfg.prompt_template, longest, progress
            )
        except prompts.PromptError as err:
            raise PrepareError(str(err)) from err
    else:
        values, offsets, truncated = tokenize(texts, tok, progress)
    labels = df["label"].to_numpy()
    table = _arrow_table(values, offsets, labels, texts if split == "test" else None)
    lengths = np.diff(offsets)
    stats = {
        "rows": len(df),
        "length_mean": float(lengths.mean()),
        "length_percentiles": {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "length_max": int(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "length_histogram": np.histogram(lengths, bins=32, range=(0, cfg.max_length))[0].tolist(),
    }
    if split == "train":
        trained = lengths  # the tokens training reads: a prompt's answer follows it
        if lm:
            trained = lengths + np.array([len(a) for a in lm["answers"]])[labels]
        stats["real_token_share"] = padding_figures(trained, cfg.max_length, cfg.seed)
    return table, stats


def padding_figures(lengths: np.ndarray, max_length: int, seed: int = 0) -> dict:
    """The share of real tokens in the rows that hold reviews of `lengths` at `max_length`:
    one a row padded to max_length (`padded`), to its own length bucket (`bucketed`, the
    best buckets of DEFAULT_BUCKET_MULTIPLE reach) and packed as the trainer's `packing`
    packs them (`packed`)."""
    share = dataset.real_token_share
    return {
        "padded": share(lengths, max_length, packed=False),
        "bucketed": share(
            lengths, max_length, packed=False, bucket_multiple=DEFAULT_BUCKET_MULTIPLE
        ),
        "packed": share(lengths, max_length, packed=True, seed=seed),
    }


def check_output_dir(out_dir: Path) -> None:
    """Refuse, before any work, an output that is a file, a folder already holding something
    (nothing a user wrote is overwritten), or a place that cannot be written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"output: {out_dir} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise PrepareError(f"output: {out_dir} exists and is not empty")
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as err:
        raise PrepareError(
            f"output: cannot write in {parent} ({err.strerror or type(err).__name__})"
        ) from err


def _write_atomically(tables: dict, metadata: dict, out_dir: Path, progress: bool) -> None:
    """Build the dataset folder beside `out_dir` and rename it into place when complete."""
    import datasets

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        dd = datasets.DatasetDict(
            {s: datasets.Dataset(datasets.table.InMemoryTable(t)) for s, t in tables.items()}
        )
        if not progress:
            datasets.disable_progress_bars()
        dd.save_to_disk(str(tmp))
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
        if out_dir.exists():
            if any(out_dir.iterdir()):
                raise PrepareError(f"output: {out_dir} exists and is not empty")
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_report(metadata: dict, path: str | Path) -> None:
    """An HTML report of the dataset: rows, class balance and token-length histograms."""
    rows = [
        {
            "split": split,
            "rows": s["rows"],
            "mean tokens": s["length_mean"],
            **s["length_percentiles"],
            "truncated": s["truncation_rate"],
        }
        for split, s in metadata["splits"].items()
    ]
    figures = dataset_figures(metadata)
    sections = [
        f"<p>Source <code>{metadata['source']}</code>, tokenizer <code>{metadata['tokenizer']}"
        f"</code> ({metadata.get('tokenizer_engine', 'tokenizers')}), max_length "
        f"{metadata['max_length']}. Dropped: {metadata['dropped'] or 'none'}.</p>",
        report.table(rows),
        *_padding_section(metadata),
        *(report.svg(fig) for fig in figures.values()),
    ]
    report.close(figures.values())
    Path(path).write_text(report.page("Dataset report", sections))


def _padding_section(metadata: dict) -> list[str]:
    """The real-token share of the training rows with and without packing (datasets prepared
    before it was measured have none)."""
    share = metadata["splits"]["train"].get("real_token_share")
    if not share:
        return []
    rows = [
        {"training rows": "one review a row, padded to max_length", "real tokens": share["padded"]},
        {
            "training rows": f"one review a row, in length buckets of {DEFAULT_BUCKET_MULTIPLE} "
            "(at best)",
            "real tokens": share["bucketed"],
        },
        {
            "training rows": "reviews packed in rows of max_length (packing)",
            "real tokens": share["packed"],
        },
    ]
    for row in rows:
        row["real tokens"] = f"{row['real tokens']:.1%}"
    return [
        f"<p>Real tokens in the training rows at max_length {metadata['max_length']}, the rest "
        "padding: what the trainer's <code>packing</code> setting saves.</p>",
        report.table(rows),
    ]


def dataset_figures(metadata: dict) -> dict:
    """The dataset's figures by file name: rows per class in each split, and the train split's
    token lengths with max_length (truncation) and the trainer's length buckets marked."""
    names = metadata["label_names"]
    splits = metadata["splits"]
    fig, ax = report.new_figure("Class balance", "class", "rows")
    width = 0.8 / len(splits)
    for i, (split, s) in enumerate(splits.items()):
        xs = [j + (i - (len(splits) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, s["class_counts"], width=width, label=split)
    ax.set_xticks(range(len(names)), names)
    ax.legend()
    figures = {"class_balance.svg": fig}
    max_length = metadata["max_length"]
    counts = splits["train"]["length_histogram"]
    bin_width = max_length / len(counts)
    fig, ax = report.new_figure(
        "Token lengths (train split)", "tokens per review ([CLS] and [SEP] included)", "reviews"
    )
    ax.bar([i * bin_width for i in range(len(counts))], counts, width=bin_width, align="edge")
    for edge in range(DEFAULT_BUCKET_MULTIPLE, max_length, DEFAULT_BUCKET_MULTIPLE):
        ax.axvline(edge, color="grey", linestyle=":", linewidth=0.8)
    ax.axvline(max_length, color="red", linestyle="--", label=f"max_length {max_length}")
    buckets = f"length buckets ({DEFAULT_BUCKET_MULTIPLE})"
    ax.plot([], [], color="grey", linestyle=":", label=buckets)
    ax.legend()
    figures["token_lengths.svg"] = fig
    return figures

"""The `prepare-yelp` component: reviews → tokenized Dataset and an HTML report."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Output

from kubejax.version import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def prepare_yelp(
    tokenizer: str,
    dataset: Output[Dataset],
    report: Output[HTML],
    source: str = "Yelp/yelp_review_full",
    revision: str = "",
    train_split: str = "train",
    validation_split: str = "",
    test_split: str = "test",
    text_column: str = "text",
    label_column: str = "label",
    label_mapping: str = "auto",
    num_labels: int = 0,
    max_length: int = 256,
    task: str = "classification",
    prompt_template: str = "",
    validation_fraction: float = 0.1,
    max_train_samples: int = 0,
    max_validation_samples: int = 0,
    max_test_samples: int = 0,
    deduplicate: bool = False,
    seed: int = 0,
) -> int:
    """Read Yelp reviews, clean, split and tokenize them.

    Args:
        tokenizer: Model folder or hub id whose fast tokenizer is used.
        dataset: Output folder (the kubejax tokenized format, `datasets` save_to_disk).
        report: HTML report: rows per split, class balance, token-length histogram.
        source: Hub dataset id, a file or folder (csv, tsv, json, jsonl, parquet), or an fsspec
            URI (s3://, gs://). The headerless Zhang et al. (2015) CSV layout is recognised.
        revision: Hub revision; empty for the default branch.
        train_split: Split spec, e.g. `train` or `train[:1%]`.
        validation_split: Split spec; empty carves validation out of train (stratified).
        test_split: Split spec; a single-file source has test carved out of it.
        text_column: Column with the review text.
        label_column: Column with the label.
        label_mapping: `auto` (1-based stars → 0-based, strings → sorted ids) or a JSON object
            mapping each raw label to an id.
        num_labels: Number of classes; 0 infers it. Labels outside 0..num_labels-1 are errors.
        max_length: Truncation length in tokens; at most the model's positions.
        task: `classification` (the reviews' tokens, for a classification head) or `causal-lm`
            (decoders: each review as `prompt_template`, each label's name as its answer; the
            train step then fine-tunes the model to write the answer).
        prompt_template: causal-lm: the prompt, with `{review}` where the review goes; empty:
            kubejax's default, "Review: {review}" and "Rating:" on the next line.
        validation_fraction: Share of train carved out as validation.
        max_train_samples: Stratified cap on train rows; 0 for none.
        max_validation_samples: Stratified cap on validation rows; 0 for none.
        max_test_samples: Stratified cap on test rows; 0 for none.
        deduplicate: Drop repeated texts.
        seed: Seed of the splits and caps.

    Returns:
        The number of classes.
    """
    from kubejax.data.prepare import PrepareConfig, prepare_yelp, write_report

    cfg = PrepareConfig(
        tokenizer=tokenizer,
        source=source,
        revision=revision or None,
        train_split=train_split,
        validation_split=validation_split,
        test_split=test_split,
        text_column=text_column,
        label_column=label_column,
        label_mapping=label_mapping,
        num_labels=num_labels,
        max_length=max_length,
        task=task,
        prompt_template=prompt_template,
        validation_fraction=validation_fraction,
        max_train_samples=max_train_samples,
        max_validation_samples=max_validation_samples,
        max_test_samples=max_test_samples,
        deduplicate=deduplicate,
        seed=seed,
    )
    metadata = prepare_yelp(cfg, dataset.path)
    write_report(metadata, report.path)
    for split, stats in metadata["splits"].items():
        dataset.metadata[f"{split}_rows"] = stats["rows"]
    dataset.metadata["num_labels"] = metadata["num_labels"]
    dataset.metadata["label_names"] = metadata["label_names"]
    return metadata["num_labels"]

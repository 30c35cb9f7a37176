"""SYNTHETIC Yelp-format reviews, for the offline demo and the tests.

These are generated, not real Yelp text (the project ships none). Wording depends on the star
rating, with overlap between neighbouring ratings so the task is learnable but not trivial;
lengths follow a log-normal law with a median near 110 words and a long tail, as Yelp's do.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

# Words that lean towards each rating, 1 to 5 stars.
_LEANING = {
    1: "awful terrible disgusting rude worst never refund cold filthy inedible waited horrible "
    "disappointing avoid scam sick burnt ignored",
    2: "mediocre bland slow overpriced meh lukewarm forgettable greasy dry soggy careless "
    "underwhelming stale noisy cramped sloppy",
    3: "okay decent average fine alright passable standard reasonable fair ordinary mixed "
    "acceptable typical middling moderate plain",
    4: "good tasty friendly fresh nice pleasant solid enjoyable clean quick recommend cozy "
    "satisfying generous helpful charming",
    5: "amazing excellent outstanding perfect incredible delicious wonderful fantastic superb "
    "best love flawless spectacular heavenly exceptional gem",
}
_FILLER = (
    "the a we i our they it was were and but so then with for at to of in on this that place "
    "food service staff table menu order dinner lunch night waiter server price drinks "
    "dessert parking room time visit friends family again back here there really very quite "
    "just also ordered came tried had got went said asked seemed looked felt"
).split()
_LEANING_WORDS = {k: v.split() for k, v in _LEANING.items()}

MEDIAN_WORDS = 110
_SIGMA = 0.75  # log-normal spread: p90 about 2.6× the median, like Yelp's tail


def generate_reviews(n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """`n` synthetic reviews: (stars 1..5 as int array, texts)."""
    if n < 1:
        raise ValueError(f"n: must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    stars = rng.integers(1, 6, size=n)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN_WORDS), _SIGMA, size=n), 5, 1000).astype(int)
    filler = np.array(_FILLER)
    leaning = {k: np.array(v) for k, v in _LEANING_WORDS.items()}
    texts = []
    for star, length in zip(stars, lengths, strict=True):
        words = filler[rng.integers(0, len(filler), size=length)]
        # About one word in six carries sentiment; most lean to this rating, some to a neighbour.
        n_sent = max(1, length // 6)
        shift = rng.choice([-1, 0, 0, 0, 1], size=n_sent)
        pos = rng.integers(0, length, size=n_sent)
        for p, s in zip(pos, shift, strict=True):
            k = int(np.clip(star + s, 1, 5))
            words[p] = leaning[k][rng.integers(0, len(leaning[k]))]
        text = " ".join(words)
        # Sentence breaks and the odd newline, as in real reviews.
        text = text.replace(" the ", ". The ", max(1, length // 40))
        if length > 150:
            text = text.replace(" we ", "\nWe ", 1)
        texts.append(text[0].upper() + text[1:] + ".")
    return stars, texts


def write_yelp_csv(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` synthetic reviews in the Zhang et al. (2015) Yelp CSV layout.

    No header, class 1..5 then the text, every field in double quotes, newlines written as the
    two characters `\\n`.
    """
    stars, texts = generate_reviews(n, seed)
    return write_reviews_csv(path, stars, texts)


def write_reviews_csv(path: str | Path, stars, texts: list[str]) -> Path:
    """Write reviews in the Zhang et al. (2015) Yelp CSV layout (see `write_yelp_csv`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator="\n")
        for star, text in zip(stars, texts, strict=True):
            writer.writerow([int(star), text.replace("\n", "\\n")])
    return path


def write_yelp_dir(path: str | Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """A folder with `train.csv` and `test.csv` in the original layout, like the Yelp release."""
    path = Path(path)
    write_yelp_csv(path / "train.csv", n_train, seed)
    write_yelp_csv(path / "test.csv", n_test, seed + 1)
    return path


#: The special tokens of `write_bpe_tokenizer` (Llama 3's names).
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_bpe_tokenizer(folder: str | Path, vocab_size: int = 400, seed: int = 1) -> int:
    """A byte-level BPE `tokenizer.json` as Llama 3's and Qwen's are (no pad token, BOS added
    in front), trained on SYNTHETIC reviews, for the small decoders built without a hub (the
    tests', `--profile llm`'s); returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_reviews(300, seed=seed)[1], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()

"""The tokenizer engines against Hugging Face `tokenizers`, the reference."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

from kubejax.data.synthetic import generate_reviews
from kubejax.data.tokenizer import Encoder, load_tokenizer, tokenize

HARD = [
    "Ünïcödé Café naïve façade crème brûlée",
    "東京タワー is tall 漢字테스트",
    "😀🍕🎉👍🏽❤️‍🔥 great!!!",
    "tabs\tand\nnew\rlines\x00\x01\x7f\u00a0\u2028\u200b\ufeff zero width",
    "e\u0301 combining marks \u0308o",
    "[CLS] literal [SEP] special [MASK] tokens [cls] [UNK]",
    "x" * 150 + " one word longer than max_input_chars_per_word",
    "don't stop—ever… “quoted” ‘single’ «guillemets» ¿qué? ¡sí!",
    "ﬁﬂ ① ½ ² ™ Ω ℵ ∑ √ ∞ ≠ Ａｂｃ १२३ ٣٤٥ İstanbul ß ẞ Ǆ",
    "a",
]


def _texts(vocab: list[str], n: int = 1200) -> list[str]:
    rng = random.Random(0)
    pool = "".join(HARD)
    texts = list(HARD) + generate_reviews(200, seed=5)[1]
    for _ in range(n):
        words = [rng.choice(vocab) for _ in range(rng.randint(1, 220))]
        # Joined and decorated words, so most are not in the vocabulary as they stand.
        words = [w + rng.choice(["", "", "s", "!", "é", "中", rng.choice(pool)]) for w in words]
        texts.append(" ".join(w.capitalize() if rng.random() < 0.1 else w for w in words))
    return texts


def _references(tok_json: str, texts: list[str], max_lengths: tuple[int, ...]):
    """`tokenizers`' own ids truncated at each of `max_lengths`, and which texts it had to cut
    (the untruncated lengths encoded once for all of them)."""
    ref = Tokenizer.from_str(tok_json)
    ref.no_padding()
    ref.no_truncation()  # a saved tokenizer.json may carry its own (MiniLM's: 128)
    full = [len(e.ids) for e in ref.encode_batch(texts)]
    out = []
    for max_length in max_lengths:
        ref.enable_truncation(max_length)
        out.append(([e.ids for e in ref.encode_batch(texts)], [n > max_length for n in full]))
    return out


def _reference(tok_json: str, texts: list[str], max_length: int):
    """`tokenizers`' own ids truncated at `max_length`, and which texts it had to cut."""
    return _references(tok_json, texts, (max_length,))[0]


def _assert_same(texts, encoder: Encoder, expected) -> None:
    ids, cut = expected
    values, offsets, truncated = tokenize(texts, encoder)
    assert [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(texts))] == ids
    assert truncated.tolist() == cut
    assert any(cut) and not all(cut)


def _bert_variants(minilm_json: dict):
    for lowercase in (True, False):
        for strip_accents in (None, True, False):
            for handle_chinese_chars in (True, False):
                d = json.loads(json.dumps(minilm_json))
                d["normalizer"].update(
                    lowercase=lowercase,
                    strip_accents=strip_accents,
                    handle_chinese_chars=handle_chinese_chars,
                    clean_text=lowercase,
                )
                yield f"lower={lowercase},strip={strip_accents},cjk={handle_chinese_chars}", d


@pytest.mark.slow
def test_native_engine_equals_tokenizers_for_every_bert_normalizer(tmp_path, minilm_dir):
    base = json.loads((minilm_dir / "tokenizer.json").read_text())
    texts = _texts([w for w in base["model"]["vocab"] if w.isalpha()], n=800)
    for name, variant in _bert_variants(base):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps(variant))
        lengths = (9, 512)
        for max_length, expected in zip(
            lengths, _references(json.dumps(variant), texts, lengths), strict=True
        ):
            encoder = load_tokenizer(str(folder), max_length)
            assert encoder.engine.startswith("nanotoken "), name
            _assert_same(texts, encoder, expected)
            assert encoder.fast is not None  # the run's own check found no difference


def test_native_engine_on_a_cased_vocabulary_trained_here(tmp_path):
    from tokenizers.implementations import BertWordPieceTokenizer

    texts = _texts(generate_reviews(300, seed=1)[1][0].split(), n=500)
    trained = BertWordPieceTokenizer(lowercase=False, strip_accents=False)
    trained.train_from_iterator(texts, vocab_size=600, show_progress=False)
    trained.save(str(tmp_path / "tokenizer.json"))
    encoder = load_tokenizer(str(tmp_path), 64)
    assert encoder.engine.startswith("nanotoken ")
    _assert_same(texts, encoder, _reference(trained.to_str(), texts, 64))


@pytest.mark.parametrize("template", ["<s> $A </s>", "<s> $A", "$A </s> </s>"])
def test_bpe_uses_tokenizers_and_truncates_before_closing_tokens(tmp_path, template):
    from tokenizers import models, pre_tokenizers, processors, trainers

    texts = generate_reviews(300, seed=2)[1]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    specials = ["<s>", "</s>", "<unk>"]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    bpe.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, bpe.token_to_id(t)) for t in specials[:2]]
    )
    bpe.save(str(tmp_path / "tokenizer.json"))
    encoder = load_tokenizer(str(tmp_path), 40)
    assert encoder.engine.startswith("tokenizers ")
    _assert_same(texts, encoder, _reference(bpe.to_str(), texts, 40))


class _OffByOne:
    """A fast engine that returns the wrong ids, to exercise the run's own check."""

    def __init__(self, real):
        self.real = real

    def encode_batch(self, texts, max_length):
        ids, offsets = self.real.encode_batch(texts, max_length=max_length)
        return ids + np.uint32(1), offsets


def test_a_difference_from_the_reference_falls_back_to_it(minilm_dir):
    texts = generate_reviews(300, seed=4)[1]
    encoder = load_tokenizer(str(minilm_dir), 48)
    encoder.fast = _OffByOne(encoder.fast)
    with pytest.warns(UserWarning, match="differs from `tokenizers`"):
        values, offsets, _ = tokenize(texts, encoder)
    assert encoder.fast is None and encoder.engine.startswith("tokenizers ")
    expected, _ = _reference((minilm_dir / "tokenizer.json").read_text(), texts, 48)
    assert [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(texts))] == expected

"""Reviews as prompts and labels as answers, for fine-tuning a decoder as a language model
(`task=causal-lm`).

A review becomes `prompt_template` with the review in place of `{review}`, tokenized as the
tokenizer defines it (its BOS in front, nothing after: a decoder's tokenizer); a label's answer
is its name after a space (" 4" for a four-star review), the tokens the model learns to write
after the prompt. Long reviews are cut so that the prompt and the longest answer fit
`max_length`, the review's tokens giving way, never the template's. Training, evaluation and the
served model all build prompts here, so they read the same tokens.
"""

from __future__ import annotations

import string

import numpy as np

from kubejax.data.tokenizer import Encoder, tokenize
from kubejax.errors import KubejaxError

#: The review's placeholder in a prompt template.
PLACEHOLDER = "{review}"
DEFAULT_PROMPT_TEMPLATE = "Review: {review}\nRating:"
#: What comes before a label's name in its answer.
ANSWER_PREFIX = " "


class PromptError(KubejaxError, ValueError):
    """A prompt template or label texts that cannot be used; the message names the setting."""


def check_template(template: str) -> tuple[str, str]:
    """The text before and after `{review}`; refused without it or with other placeholders."""
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    if fields != ["review"]:
        raise PromptError(
            f"prompt_template: {template!r} must hold {PLACEHOLDER} exactly once and no other "
            f"{{...}} field (found {fields or 'none'}); write literal braces as {{{{ }}}}"
        )
    before, after = template.split(PLACEHOLDER)
    return before.replace("{{", "{").replace("}}", "}"), after.replace("{{", "{").replace("}}", "}")


def answer_ids(encoder: Encoder, label_names: list[str]) -> list[list[int]]:
    """Each label's answer as token ids (no special tokens); a label whose answer tokenizes to
    nothing is refused."""
    answers = []
    for name in label_names:
        ids = encoder.reference.encode(ANSWER_PREFIX + str(name), add_special_tokens=False).ids
        if not ids or not str(name).strip():
            raise PromptError(
                f"label_names: the label {name!r} gives an empty answer; causal-lm needs a "
                "label text that tokenizes to at least one token (set label_mapping)"
            )
        answers.append(list(ids))
    return answers


def encode_prompts(
    texts: list[str], encoder: Encoder, template: str, answer_tokens: int, progress: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of each review's prompt, as `tokenize` gives them (flat values, offsets,
    truncated mask), at most `encoder.max_length - answer_tokens` tokens each."""
    before, after = check_template(template)
    if encoder.trailing:
        raise PromptError(
            f"task: causal-lm needs a decoder's tokenizer; this one adds {encoder.trailing} "
            "token(s) after every text (an encoder's [SEP])"
        )
    suffix = np.asarray(encoder.reference.encode(after, add_special_tokens=False).ids, np.int32)
    budget = encoder.max_length - answer_tokens - len(suffix)
    if budget < 8:
        raise PromptError(
            f"max_length: {encoder.max_length} leaves {budget} tokens for a review after the "
            f"template's {len(suffix)} and the longest answer's {answer_tokens}; raise it"
        )
    review = Encoder(encoder.reference, budget)
    values, offsets, truncated = tokenize([before + t for t in texts], review, progress)
    # The template's tail after every review.
    lengths = np.diff(offsets)
    out_offsets = np.zeros_like(offsets)
    np.cumsum(lengths + len(suffix), out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), np.int32)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    out[out_offsets[rows] + np.arange(len(values)) - offsets[rows]] = values
    out[(out_offsets[:-1] + lengths)[:, None] + np.arange(len(suffix))] = suffix
    encoder.reference.enable_truncation(encoder.max_length + 1)  # as `encoder` set it
    return out, out_offsets, truncated

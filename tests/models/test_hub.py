"""A hub id as `model`: which of the repository's files are fetched, and when.

The hub is a fake at the network boundary: `huggingface_hub.snapshot_download` replaced by a
function that copies, from a local folder standing for the repository, the files its
`allow_patterns` select (through huggingface_hub's own `filter_repo_objects`, as the real one
does) into one snapshot folder, and records them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from kubejax.models import weights
from kubejax.trainer.train import main as trainer_main
from tests.helpers import tiny_args


class FakeHub:
    """One repository, `repo` (a folder), served under any id."""

    def __init__(self, repo: Path, cache: Path):
        self.repo, self.snapshot = repo, cache / "snapshots" / "0123abcd"
        self.fetched: list[str] = []

    def snapshot_download(self, repo_id: str, allow_patterns: list[str]) -> str:
        names = sorted(p.relative_to(self.repo).as_posix() for p in self.repo.rglob("*"))
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            if (self.repo / name).is_file():
                (self.snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.repo / name, self.snapshot / name)
                self.fetched.append(name)
        self.snapshot.mkdir(parents=True, exist_ok=True)
        return str(self.snapshot)


def _hub(tmp_path, monkeypatch, files: dict[str, str]) -> FakeHub:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    hub = FakeHub(repo, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    return hub


def test_fake_hub_mistral_repository_gives_the_indexed_shards_and_not_consolidated(
    tmp_path, monkeypatch
):
    """Mistral's repositories hold mistral-inference's consolidated.safetensors (as large as
    the model) beside transformers' shards, Llama's their original .pth: only the shards
    the index names are fetched, and only once the weights are asked for."""
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    tokenizer = dict.fromkeys(weights.TOKENIZER_FILES, "{}")
    hub = _hub(tmp_path, monkeypatch, {
        "config.json": "{}", weights.SAFETENSORS_INDEX: json.dumps(index),
        "model-00001-of-00002.safetensors": "1", "model-00002-of-00002.safetensors": "2",
        "consolidated.safetensors": "c", "params.json": "{}", "tokenizer.model.v3": "t",
        "original/consolidated.00.pth": "p", "README.md": "r", **tokenizer,
    })  # fmt: skip
    folder = weights.resolve_model_dir("mistralai/Mistral-7B-v0.3", weights=False)
    # Every file a model folder's export copies from its tokenizer folder, and no weights.
    assert set(weights.TOKENIZER_FILES) <= set(hub.fetched)
    assert not [n for n in hub.fetched if n.endswith((".safetensors", ".pth", ".bin"))]
    assert {"config.json", weights.SAFETENSORS_INDEX} <= set(hub.fetched)
    before = set(hub.fetched)
    assert weights.resolve_model_dir("mistralai/Mistral-7B-v0.3") == folder
    shards = {n for n in hub.fetched if n not in before}
    assert shards == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert "README.md" not in hub.fetched


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"model.safetensors": "s", "pytorch_model.bin": "b"}, ["model.safetensors"]),
        ({"pytorch_model.bin": "b", "tf_model.h5": "h"}, ["pytorch_model.bin"]),
    ],
    ids=["safetensors-beside-bin", "bin-only"],
)
def test_fake_hub_single_file_repository_gives_one_weight_file(
    tmp_path, monkeypatch, files, expected
):
    hub = _hub(tmp_path, monkeypatch, {"config.json": "{}", **files})
    folder = weights.resolve_model_dir("org/model")
    assert [n for n in hub.fetched if n != "config.json"] == expected
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", *expected])


@pytest.mark.slow
def test_fake_hub_a_run_that_cannot_fit_is_refused_before_any_weight_is_fetched(
    tmp_path, monkeypatch, capsys, tiny_decoder_dir, prepared_decoder
):
    hub = _hub(tmp_path, monkeypatch, {})
    shutil.copytree(tiny_decoder_dir, hub.repo, dirs_exist_ok=True)
    args = tiny_args("org/tiny-qwen2", prepared_decoder, tmp_path / "out", device_memory="1KiB")
    assert trainer_main(args) == 2
    assert "device_memory: the run needs" in capsys.readouterr().err
    assert "config.json" in hub.fetched
    assert not [n for n in hub.fetched if n.endswith(".safetensors")]
    # The same id within the budget fetches the weights and trains.
    args = tiny_args("org/tiny-qwen2", prepared_decoder, tmp_path / "out", max_steps=1)
    assert trainer_main(args) == 0
    assert "model.safetensors" in hub.fetched


def test_fake_hub_an_unreadable_index_is_refused_naming_the_model(
    tmp_path, monkeypatch, capsys, tiny_decoder_dir, prepared_decoder
):
    hub = _hub(tmp_path, monkeypatch, {weights.SAFETENSORS_INDEX: "{not json"})
    shutil.copy(tiny_decoder_dir / "config.json", hub.repo / "config.json")
    args = tiny_args("org/broken", prepared_decoder, tmp_path / "out")
    assert trainer_main(args) == 2
    assert "model: org/broken:" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.json").exists()

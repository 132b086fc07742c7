"""Where the checkpoint comes from: explicit model > DEEPINFER_HF_MODEL_DIR > default hub id (no network here)."""

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from deepinfer_core.weights import (
    DEFAULT_MODEL_ID,
    CheckpointNotFound,
    resolve,
    resolve_model_path,
)

ENV = "DEEPINFER_HF_MODEL_DIR"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake `snapshot_download` that records its calls; the network is never touched."""
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        target = tmp_path / "hub-cache" / repo_id.replace("/", "--")
        target.mkdir(parents=True, exist_ok=True)
        return str(target)

    monkeypatch.setattr(resolve, "snapshot_download", snapshot_download)
    monkeypatch.delenv(ENV, raising=False)
    return calls


def test_explicit_directory_is_used_as_is(hub, tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path) == tmp_path
    assert hub == []


def test_explicit_model_wins_over_the_environment_variable(hub, tmp_path, monkeypatch):
    explicit, from_env = tmp_path / "explicit", tmp_path / "env"
    explicit.mkdir()
    from_env.mkdir()
    monkeypatch.setenv(ENV, str(from_env))
    assert resolve_model_path(str(explicit)) == explicit
    assert resolve_model_path("someone/other-model").name == "someone--other-model"
    assert [repo for repo, _ in hub] == ["someone/other-model"]


def test_environment_variable_wins_over_the_default(hub, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert resolve_model_path() == tmp_path
    assert resolve_model_path(None) == tmp_path
    assert hub == []


def test_environment_variable_naming_a_missing_directory_is_an_error(hub, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "absent"))
    with pytest.raises(CheckpointNotFound, match=f"{ENV}=.*absent"):
        resolve_model_path()


def test_default_model_is_downloaded_with_weights_json_and_tokenizer_files_only(hub):
    path = resolve_model_path()
    assert path.name == DEFAULT_MODEL_ID.replace("/", "--")
    ((repo, kwargs),) = hub
    assert repo == DEFAULT_MODEL_ID == "deepseek-ai/DeepSeek-V4.1-Flash-1017"
    patterns = kwargs["allow_patterns"]
    assert {"*.safetensors", "*.json"} <= set(patterns)
    assert not any(p.endswith((".bin", ".pt", ".pth", ".ckpt")) for p in patterns)


def test_offline_hub_error_names_the_model_and_what_to_do(monkeypatch):
    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(resolve, "snapshot_download", offline)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(CheckpointNotFound, match=r"'deepseek-ai/DeepSeek-V4\.1-Flash-1017'.*default model.*offline"):
        resolve_model_path()
    with pytest.raises(CheckpointNotFound, match=r"'owner/missing'.*model argument"):
        resolve_model_path("owner/missing")


def test_missing_local_path_is_not_sent_to_the_hub(hub, tmp_path):
    with pytest.raises(CheckpointNotFound, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))
    with pytest.raises(CheckpointNotFound, match="a/b/c"):
        resolve_model_path("a/b/c")
    assert hub == []


def test_a_file_is_not_a_checkpoint_directory(hub, tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(CheckpointNotFound, match="not a directory"):
        resolve_model_path(str(file))

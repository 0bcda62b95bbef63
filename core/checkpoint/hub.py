"""Hugging Face hub model ids (`moonshotai/Kimi-K3`) as checkpoint directories.

`resolve_model(model, revision=..., download_dir=...)` returns the local directory of `model`:

- an existing directory is returned as given (a local checkpoint; `revision` does not apply);
- a repo id (`org/name`, one slash, not a path on disk) is looked up in the hub cache first
  (`huggingface_hub.snapshot_download(..., local_files_only=True)`): `download_dir` if given
  (vLLM's `--download-dir`), else `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`, all read when called; `revision` is a branch, tag or commit
  (default `main`, the cache's `refs/main`);
- a repo id missing from the cache is downloaded (huggingface_hub's progress bars on stderr)
  unless `HF_HUB_OFFLINE` is set; offline, or when the download fails, `HubError` says in one
  line what is missing and the command that fetches it.

Anything else (a path that does not exist, not shaped like a repo id) is returned unchanged, so
the caller's "not a checkpoint directory" check reports it. Only the files serving needs are
fetched (`ALLOW_PATTERNS`: config, safetensors weights and index, tokenizer and chat template
files, generation config). huggingface_hub is imported only for repo ids.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# the files of a checkpoint directory k3 reads (weights as safetensors only: no *.bin / *.pt)
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")
_REPO_ID = re.compile(r"[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*")
_TRUE = {"1", "on", "yes", "true"}


class HubError(Exception):
    """A hub model id that cannot be made a local directory; the message is one line naming the
    command that fetches it."""


def is_repo_id(model: str) -> bool:
    """True when `model` reads as a hub repo id (`org/name`) and is not a path on disk."""
    return bool(_REPO_ID.fullmatch(model)) and not Path(model).exists()


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """The hub cache a lookup uses: `download_dir`, else $HF_HUB_CACHE, else $HF_HOME/hub,
    else ~/.cache/huggingface/hub (the environment read now, not at import)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set to a true value (1, on, yes, true)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def fetch_command(repo_id: str, revision: str | None, download_dir: str | os.PathLike | None) -> str:
    """The shell command that puts `repo_id` into the cache k3 reads."""
    cmd = f"hf download {repo_id}"
    if revision:
        cmd += f" --revision {revision}"
    if download_dir is not None:
        cmd += f" --cache-dir {download_dir}"
    return cmd


def resolve_model(model: str | os.PathLike, *, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None) -> Path:
    """The local checkpoint directory of `model` (a directory, or a hub repo id: see the module);
    raises HubError (one line) when a repo id is neither cached nor downloadable."""
    name = str(model)
    if not is_repo_id(name):
        return Path(model)
    try:
        import huggingface_hub
    except ImportError:
        raise HubError(f"{name} looks like a Hugging Face repo id, but huggingface_hub is not installed: "
                       "pip install huggingface_hub (or pass a local checkpoint directory)") from None
    cache = hub_cache_dir(download_dir)
    where = f"{name}{'@' + revision if revision else ''}"
    try:
        return Path(huggingface_hub.snapshot_download(name, revision=revision, cache_dir=str(cache),
                                                      local_files_only=True, allow_patterns=list(ALLOW_PATTERNS)))
    except Exception as e:                 # LocalEntryNotFoundError (its home moved between versions)
        if not _is_missing(e):
            raise HubError(f"cannot read {where} from the hub cache {cache}: {_one_line(e)}") from None
    fetch = fetch_command(name, revision, download_dir)
    if hub_offline():
        raise HubError(f"{where} is not in the hub cache {cache} and HF_HUB_OFFLINE is set; fetch it with: {fetch}")
    try:
        return Path(huggingface_hub.snapshot_download(name, revision=revision, cache_dir=str(cache),
                                                      allow_patterns=list(ALLOW_PATTERNS)))
    except Exception as e:                 # no network, unknown repo or revision, gated repo, disk full
        raise HubError(f"cannot download {where} into {cache} ({_one_line(e)}); fetch it with: {fetch}") from None


def _is_missing(error: Exception) -> bool:
    """True for huggingface_hub's "not in the local cache" error (whatever module it lives in)."""
    return any(cls.__name__ in ("LocalEntryNotFoundError", "EntryNotFoundError", "IncompleteSnapshotError") for cls in type(error).__mro__)


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."

"""Models and data sets from the Hugging Face Hub, downloaded once into the trainer's state dir:

    STATE/hub/models/OWNER/NAME/REVISION/          a model's config, tokenizer and safetensors files
    STATE/hub/datasets/[OWNER/]NAME/main/          a data set's data files (and its README.md, which
                                                   may name its configurations)
    STATE/hub/.../REVISION.commit                  written once every file is there: the commit
    STATE/hub/.cache/                              huggingface_hub's own bookkeeping

A download counts only once its `.commit` is written (a kill mid-download goes on where it
stopped); a trainer started again on the state dir then asks the hub nothing. Everything that
reads the model or the data (models.load, fsdp.from_files, tasks.dataset) reads these folders,
by `localize`. huggingface_hub reads the token from HF_TOKEN itself; nothing here writes it
anywhere. HF_ENDPOINT (another hub, a mirror) is read at each call.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from sparrowrl.spec.job import JobSpec

log = logging.getLogger(__name__)

# what a model needs, at the repo's top level: weights as safetensors only (never pickles: *.bin,
# *.pt), the config and tokenizer files, a chat template; not other formats or other folders
MODEL_FILES = re.compile(r"model[^/]*\.safetensors|[^/]+\.(json|jinja|txt|model|tiktoken)")
DATA_FILES = (".parquet", ".json", ".jsonl", ".csv", ".arrow")
_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
DATASET = re.compile(rf"({_NAME}/)?{_NAME}")  # a data set's name may lack the owner (the hub's oldest ones)


class HubError(ValueError):
    """A model or data set that cannot be had from the hub; the message names the job's field."""


@dataclass(frozen=True)
class Source:
    """One repo the job takes from the hub; `field` is the job spec's field that names it."""

    field: str
    kind: str  # "model" or "dataset"
    repo: str
    revision: str

    def folder(self, state_dir: Path) -> Path:
        return state_dir / "hub" / f"{self.kind}s" / self.repo / quote(self.revision, safe="")

    def wanted(self, name: str) -> bool:
        if self.kind == "model":
            return bool(MODEL_FILES.fullmatch(name))
        parts = PurePosixPath(name).parts
        hidden = any(p.startswith(".") for p in parts)
        return not hidden and (name == "README.md" or PurePosixPath(name).suffix in DATA_FILES)


def dataset_repo(path: str) -> str | None:
    """The hub name a task.dataset.path stands for, or None: a local file or folder, which the
    job loader has made absolute (relative to the job file) where it exists."""
    return None if Path(path).is_absolute() else path


def sources(spec: JobSpec) -> list[Source]:
    out = []
    if spec.model.hub:
        out.append(Source("model.hub", "model", spec.model.hub.repo, spec.model.hub.revision))
    if spec.task.dataset and (name := dataset_repo(spec.task.dataset.path)) is not None:
        out.append(Source("task.dataset.path", "dataset", name, "main"))
    ev = spec.task.eval
    if ev and ev.dataset and (name := dataset_repo(ev.dataset.path)) is not None:
        if not any(s.kind == "dataset" and s.repo == name for s in out):  # one download for both
            out.append(Source("task.eval.dataset.path", "dataset", name, "main"))
    return out


def fetched(src: Source, state_dir: Path) -> bool:
    folder = src.folder(state_dir)
    return folder.with_name(folder.name + ".commit").is_file()


def localize(spec: JobSpec, state_dir: Path) -> JobSpec:
    """`spec` with the downloads' folders as model.path and task.dataset.path, as everything
    that loads a model or a data set reads them. HubError: one is not downloaded (`fetch`)."""
    updates: dict[str, Any] = {}  # a ModelSpec, a TaskSpec
    for src in sources(spec):
        if not fetched(src, state_dir):
            raise HubError(f"{src.field}: {src.repo} is not downloaded into {state_dir / 'hub'}")
        folder = str(src.folder(state_dir))
        if src.kind == "model":
            updates["model"] = spec.model.model_copy(update={"path": folder, "hub": None})
        else:
            task = updates.get("task", spec.task)
            fields: dict[str, Any] = {}
            if task.dataset and dataset_repo(task.dataset.path) == src.repo:
                fields["dataset"] = task.dataset.model_copy(update={"path": folder})
            ev = task.eval
            if ev and ev.dataset and dataset_repo(ev.dataset.path) == src.repo:
                fields["eval"] = ev.model_copy(update={"dataset": ev.dataset.model_copy(update={"path": folder})})
            updates["task"] = task.model_copy(update=fields)
    return spec.model_copy(update=updates) if updates else spec


def _endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def info(src: Source):
    """The repo at its revision, with its files (one request); HubError names why not."""
    from huggingface_hub import HfApi

    if src.kind == "dataset" and (not DATASET.fullmatch(src.repo) or "--" in src.repo or ".." in src.repo):
        raise HubError(
            f"{src.field}: {src.repo} is no local file or folder (paths are relative to the job file), nor a data "
            f"set's name on the hub ([owner/]name)"
        )
    with _errors(src):
        return HfApi(endpoint=_endpoint()).repo_info(
            src.repo, revision=src.revision, repo_type=src.kind, files_metadata=True
        )


def check(spec: JobSpec, state_dir: Path | None = None) -> None:
    """What can be known of the job's hub repos without downloading them: each exists at its
    revision, can be read with this HF_TOKEN, and holds what the job needs. A repo already
    downloaded into `state_dir` is not asked again."""
    for src in sources(spec):
        if state_dir is None or not fetched(src, state_dir):
            _files(src, info(src))


def _files(src: Source, repo_info) -> dict[str, int | None]:
    """The files of the repo to download, with their sizes; HubError: it lacks what is needed."""
    files = {s.rfilename: s.size for s in repo_info.siblings or [] if src.wanted(s.rfilename)}
    where = f"{src.repo} at {src.revision}"
    if src.kind == "model":
        if "config.json" not in files:
            raise HubError(f"{src.field}: {where} has no config.json: not a transformers model")
        if not any(n.endswith(".safetensors") for n in files):
            raise HubError(
                f"{src.field}: {where} has no safetensors weights (model*.safetensors); other formats are not "
                f"downloaded"
            )
    elif not any(not n.endswith(".md") for n in files):
        raise HubError(f"{src.field}: {where} holds no data files ({', '.join(DATA_FILES)})")
    return files


def fetch(spec: JobSpec, state_dir: Path) -> None:
    """Download what the job takes from the hub into `state_dir`, unless it is there already."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    for src in sources(spec):
        if fetched(src, state_dir):
            continue
        repo_info = info(src)
        files = _files(src, repo_info)
        folder = src.folder(state_dir)
        log.info(f"trainer: downloading {src.kind} {src.repo} at {src.revision} ({len(files)} files)")
        with _errors(src):
            snapshot_download(
                src.repo,
                repo_type=src.kind,
                revision=repo_info.sha,  # the commit: the listing and every file come from the same one
                allow_patterns=[_literal(n) for n in files],
                local_dir=folder,
                cache_dir=state_dir / "hub" / ".cache",
                endpoint=_endpoint(),
            )
        for name, size in files.items():  # snapshot_download may hand back what it had when the hub went away
            got = folder / name
            if not got.is_file() or (size is not None and got.stat().st_size != size):
                raise HubError(f"{src.field}: {src.repo}: {name} did not download whole; start again to go on")
        folder.with_name(folder.name + ".commit").write_text(f"{repo_info.sha}\n")


def _literal(name: str) -> str:
    """A file name as an fnmatch pattern that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextmanager
def _errors(src: Source) -> Iterator[None]:
    """huggingface_hub's errors as HubError, naming the field and what to do."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{src.repo} on {_endpoint()}"
    need = "the token in HF_TOKEN cannot read it" if os.environ.get("HF_TOKEN") else "set HF_TOKEN to one that can"
    repo_field, revision_field = ("model.hub.repo", "model.hub.revision") if src.kind == "model" else (src.field,) * 2
    try:
        yield
    except RevisionNotFoundError:
        raise HubError(f"{revision_field}: {src.repo} has no branch, tag or commit {src.revision!r}") from None
    except GatedRepoError:
        raise HubError(f"{src.field}: {where} is gated: accept its terms on the hub; {need}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_field}: no {src.kind} {where}, or a private one that needs a token: {need}") from None
    except OfflineModeIsEnabled:
        raise HubError(f"{src.field}: {src.repo} is not downloaded here, and HF_HUB_OFFLINE is set") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise HubError(f"{src.field}: {where}: HTTP {status}: {need}") from None
        raise HubError(f"{src.field}: {where}: {_first_line(e)}") from None
    except (httpx2.HTTPError, LocalEntryNotFoundError) as e:
        raise HubError(
            f"{src.field}: cannot download {src.repo} from {_endpoint()} ({_first_line(e)}); check the network, or "
            f"HF_ENDPOINT"
        ) from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

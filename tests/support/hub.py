"""A stand-in for the Hugging Face Hub on loopback: the outer edge of every test that takes a
model or a data set from the hub, as kube.py is for clusters. Nothing in the tests reaches the
real hub.

It serves repos from folders a test saved, with just the routes huggingface_hub's
`repo_info`, `list_repo_tree`, `snapshot_download` and `hf_hub_download` call (read off
huggingface_hub 2.4's hf_api.py and file_download.py):

    GET  /api/{models,datasets}/REPO/revision/REV     the repo's commit and files (siblings)
    GET  /api/{models,datasets}/REPO/tree/REV         its files, recursively (one page)
    HEAD /[datasets/]REPO/resolve/REV/FILE            X-Repo-Commit, ETag, Content-Length
    GET  /[datasets/]REPO/resolve/REV/FILE            the bytes (a Range from an offset resumes)

REV is "main" or the repo's commit. A missing repo, revision or file is a 404 with the
X-Error-Code that huggingface_hub turns into its errors; a private repo answers 401 unless
`Authorization: Bearer TOKEN` carries the hub's token. Every request is counted, so a test can
tell that a restart asked nothing. Point HF_ENDPOINT at `url`."""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from support.servers import listen

API = re.compile(r"/api/(models|datasets)/(.+)/(revision|tree)/([^/]+)(/.*)?")
RESOLVE = re.compile(r"/(datasets/)?(.+)/resolve/([^/]+)/(.+)")


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    private: bool


class Hub:
    """`with Hub() as hub:` serves on 127.0.0.1 from its own thread until the block ends."""

    def __init__(self, token: str = "hf_test_token"):
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of each request, in order
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def add(self, kind: str, repo: str, folder: Path, private: bool = False) -> str:
        """Serve `folder`'s files (read now) as repo `repo` of `kind` (model or dataset); its commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(b"".join(n.encode() + hashlib.sha256(b).digest() for n, b in files.items())).hexdigest()
        self.repos[(kind, repo)] = Repo(files, sha, private)
        return sha

    def __enter__(self) -> Hub:
        self._thread.start()
        self._runner, self.url = asyncio.run_coroutine_threadsafe(listen(self._app()), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    def _find(self, request: web.Request, kind: str, repo: str, rev: str) -> Repo:
        r = self.repos.get((kind, repo))
        if r is None:
            raise _error(404, "RepoNotFound", "Repository not found")
        if r.private and request.headers.get("Authorization") != f"Bearer {self.token}":
            if "Authorization" in request.headers:
                raise _error(401, None, "Invalid credentials in Authorization header")
            raise _error(401, "RepoNotFound", "Repository not found")
        if rev not in ("main", r.sha):
            raise _error(404, "RevisionNotFound", "Invalid rev id: " + rev)
        return r

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if m := API.fullmatch(request.path):
            kind, repo, what, rev = m.group(1)[:-1], m.group(2), m.group(3), m.group(4)
            r = self._find(request, kind, repo, rev)
            if what == "revision":
                siblings = [{"rfilename": n, "size": len(b)} for n, b in r.files.items()]
                return web.json_response({"id": repo, "sha": r.sha, "private": r.private, "siblings": siblings})
            return web.json_response(
                [
                    {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in r.files.items()
                ]
            )
        if m := RESOLVE.fullmatch(request.path):
            kind = "dataset" if m.group(1) else "model"
            r = self._find(request, kind, m.group(2), m.group(3))
            body = r.files.get(m.group(4))
            if body is None:
                raise _error(404, "EntryNotFound", "Entry not found")
            headers = {"X-Repo-Commit": r.sha, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
            rng = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
            start = int(rng.group(1)) if rng else 0
            return web.Response(body=body[start:], status=206 if start else 200, headers=headers)
        raise _error(404, None, "Not found")


def _error(status: int, code: str | None, message: str) -> web.HTTPException:
    headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
    return {401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status](headers=headers, text=message)

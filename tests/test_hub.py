"""Models and data sets from the Hugging Face Hub, against the loopback stand-in
(tests/support/hub.py): downloaded once into the state dir, only the files a model needs, read
from there by everything that loads them, never asked for again by a restarted trainer, and
every way the hub can refuse named by the job's field."""

from __future__ import annotations

import json

import pytest
from support import jobs
from support.hub import Hub
from support.models import TEMPLATE, save_tiny

from sparrowrl.spec.job import parse
from sparrowrl.trainer import hub, models, tasks
from sparrowrl.trainer.learner import Learner

pytestmark = pytest.mark.timeout(300)


def job(model: dict, task: dict | None = None):
    """The spec of a tiny job of `model` and `task` (the add task if none)."""
    grpo = {"groupSize": 2, "promptsPerStep": 2, "maxNewTokens": 2}
    return parse(jobs.job(steps=2, grpo=grpo, model=model, task=task or {"builtin": "add"})).spec


@pytest.fixture
def saved(tmp_path):
    """A tiny model with a chat-template tokenizer (and a pickle beside it, never downloaded),
    and a data set of JSONL data files."""
    save_tiny(tmp_path / "model")
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"a pickle")
    (tmp_path / "data" / "data").mkdir(parents=True)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a % 2} for a in range(5)]
    (tmp_path / "data" / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.fixture
def stand_in(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing lands in the user's cache
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with Hub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        h.add("model", "me/tiny", saved / "model")
        h.add("model", "me/secret", saved / "model", private=True)
        h.add("dataset", "me/qa", saved / "data")
        yield h


def test_the_stand_in_serves_a_saved_model_byte_for_byte(stand_in, saved, tmp_path):
    from huggingface_hub import snapshot_download

    got = snapshot_download("me/tiny", local_dir=tmp_path / "got", cache_dir=tmp_path / "cache", endpoint=stand_in.url)
    files = sorted(p.name for p in (saved / "model").iterdir())
    assert sorted(p.name for p in (tmp_path / "got").iterdir() if p.is_file()) == files
    for name in files:
        assert (tmp_path / "got" / name).read_bytes() == (saved / "model" / name).read_bytes(), name
    assert got == str(tmp_path / "got")


def test_a_model_and_a_data_set_download_once_and_a_restarted_trainer_asks_nothing(stand_in, saved, tmp_path):
    spec = job({"hub": {"repo": "me/tiny"}}, {"dataset": {"path": "me/qa"}, "reward": "exact"})
    state = tmp_path / "state"
    first = Learner(spec, state)
    first.stop()
    first.held.close()
    folder = state / "hub" / "models" / "me" / "tiny" / "main"
    wanted = {p.name for p in (saved / "model").iterdir()} - {"pytorch_model.bin"}  # no pickles
    assert {p.name for p in folder.iterdir() if p.is_file()} == wanted
    for name in wanted:
        assert (folder / name).read_bytes() == (saved / "model" / name).read_bytes()
    assert (state / "hub" / "datasets" / "me" / "qa" / "main" / "data" / "train.jsonl").is_file()
    assert {first.task.example(i).prompt for i in range(5)} == {f"u:{a}+{a}=<a:" for a in range(5)}
    assert (state / "model" / "chat_template.jinja").read_text() == TEMPLATE  # what workers build from
    asked = len(stand_in.requests)
    assert asked > 0

    again = Learner(spec, state)  # the same state dir, as a restarted trainer
    again.stop()
    again.held.close()
    assert len(stand_in.requests) == asked and again.restarts == 1
    assert models.policy_state(again.model).keys() == models.policy_state(first.model).keys()
    hub.check(spec, state)  # `sparrowrl run --resume`'s check: the download is there, nothing is asked
    assert len(stand_in.requests) == asked


def test_a_private_model_needs_the_token(stand_in, tmp_path, monkeypatch):
    spec = job({"hub": {"repo": "me/secret"}})
    with pytest.raises(hub.HubError, match=r"^model.hub.repo: no model me/secret on .*set HF_TOKEN to one that can"):
        hub.check(spec)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(hub.HubError, match=r"^model.hub: me/secret on .*: HTTP 401: the token in HF_TOKEN cannot"):
        hub.check(spec)
    monkeypatch.setenv("HF_TOKEN", stand_in.token)
    hub.fetch(spec, tmp_path / "state")
    models.check(hub.localize(spec, tmp_path / "state").model.path)
    files = [p for p in (tmp_path / "state").rglob("*") if p.is_file()]
    assert stand_in.token not in "".join(p.read_text(errors="replace") for p in files)  # never on disk


def test_what_the_hub_refuses_is_named_by_the_field(stand_in, saved, tmp_path):
    cases = [
        ({"hub": {"repo": "me/nope"}}, None, r"^model.hub.repo: no model me/nope on http://127.0.0.1:\d+"),
        (
            {"hub": {"repo": "me/tiny", "revision": "v9"}},
            None,
            "^model.hub.revision: me/tiny has no branch, tag or commit 'v9'",
        ),
        (jobs.tiny(), {"dataset": {"path": "me/nope"}}, "^task.dataset.path: no dataset me/nope on"),
        (
            jobs.tiny(),
            {"dataset": {"path": "no such data!"}},
            "^task.dataset.path: no such data! is no local file or folder",
        ),
    ]
    for model, task, message in cases:
        with pytest.raises(hub.HubError, match=message):
            hub.check(job(model, task))
    (saved / "model" / "model.safetensors").unlink()
    stand_in.add("model", "me/pickled", saved / "model")
    with pytest.raises(hub.HubError, match=r"^model.hub: me/pickled at main has no safetensors weights"):
        hub.check(job({"hub": {"repo": "me/pickled"}}))
    with pytest.raises(hub.HubError, match=r"^model.hub: me/tiny is not downloaded into"):
        hub.localize(job({"hub": {"repo": "me/tiny"}}), tmp_path / "state")


def test_a_hub_that_cannot_be_reached(saved, tmp_path, monkeypatch):
    with Hub() as h:
        url = h.url
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(hub.HubError, match=rf"^model.hub: cannot download me/tiny from {url} .*check the network"):
        hub.fetch(job({"hub": {"repo": "me/tiny"}}), tmp_path / "state")
    assert not (tmp_path / "state" / "hub").exists()


def test_only_repo_ids_and_revisions_the_hub_allows():
    from sparrowrl.spec.job import JobError

    for model, message in [
        ({"repo": "tiny"}, "model.hub.repo: 'tiny' is not a repo id, owner/name"),
        ({"repo": "me/a--b"}, "model.hub.repo: 'me/a--b' is not a repo id"),
        ({"repo": "me/tiny", "revision": "../x"}, "model.hub.revision: '../x' is not a branch, tag or commit"),
        ({"repo": "me/" + "x" * 97}, "model.hub.repo"),
    ]:
        with pytest.raises(JobError, match=message):
            job({"hub": model})
    with pytest.raises(JobError, match="give exactly one of model.path .*, model.tiny and model.hub"):
        job({"hub": {"repo": "me/tiny"}, "path": "/x"})
    assert job({"hub": {"repo": "me/tiny", "revision": "refs/pr/1"}}).model.hub.revision == "refs/pr/1"


def test_a_data_set_folder_from_the_hub_reads_as_a_local_one(stand_in, tmp_path):
    spec = job(jobs.tiny(), {"dataset": {"path": "me/qa"}})
    hub.fetch(spec, tmp_path / "state")
    what, rows = tasks.dataset(hub.localize(spec, tmp_path / "state").task.dataset)
    got = [src for _, src in rows]
    assert [(s.prompt, s.answer, s.fields) for s in got] == [
        (f"{a}+{a}=", str(2 * a), {"level": a % 2}) for a in range(5)
    ]
    assert "me/qa" in what


def test_a_held_out_data_set_from_the_hub_is_fetched_with_the_others_and_read_in_order(stand_in, tmp_path):
    """task.eval.dataset names a data set on the hub: fetched into the state dir as the training
    data set is (one download when both name the same), and read in file order, the first
    `prompts` of it."""
    spec = job(jobs.tiny(), {"builtin": "add", "eval": {"dataset": {"path": "me/qa"}, "prompts": 3}})
    state = tmp_path / "state"
    learner = Learner(spec, state)
    learner.stop()
    learner.held.close()
    assert [(x.prompt, x.answer) for x in learner.held_out] == [(f"{a}+{a}=", str(2 * a)) for a in range(3)]
    assert (state / "hub" / "datasets" / "me" / "qa" / "main" / "data" / "train.jsonl").is_file()
    both = job(jobs.tiny(), {"dataset": {"path": "me/qa"}, "eval": {"dataset": {"path": "me/qa"}}})
    assert [s.field for s in hub.sources(both)] == ["task.dataset.path"]
    local = hub.localize(both, state)
    assert (
        local.task.dataset.path
        == local.task.eval.dataset.path
        == str(state / "hub" / "datasets" / "me" / "qa" / "main")
    )

"""User tasks: JSONL lines and `datasets` rows in either shape (a prompt, or chat messages), their
other fields, the chat template, bad rows refused or skipped, and the reward's signature checked
at start. Data sets are local files here: nothing is downloaded."""

import json
import subprocess
import sys

import huggingface_hub
import pytest
from support.models import chat_tokenizer

from sparrowrl.spec.task import TaskSpec
from sparrowrl.trainer import models, rewards, tasks


def rows(path, prompts=None, **task) -> tasks.Rows:
    t = TaskSpec(jsonl=str(path), **task)
    return tasks.Rows(0, prompts or models.Prompts(models.char_tokenizer()), tasks.jsonl(path), t, str(path))


def lines(path, *objs) -> None:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def test_plain_and_chat_lines_keep_their_other_fields(tmp_path):
    f = tmp_path / "t.jsonl"
    lines(
        f,
        {"prompt": "2*3=", "answer": 6, "level": 2, "tags": ["x"]},
        "",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}], "answer": "2"},
    )
    t = rows(f)
    got = sorted((t.example(i) for i in range(2)), key=lambda e: e.answer)
    assert [(e.prompt, e.answer, e.fields) for e in got] == [
        ("be brief\n1+1=", "2", {}),  # no chat template: the contents, joined by newlines
        ("2*3=", "6", {"level": 2, "tags": ["x"]}),  # a number answer is its text
    ]
    assert t.field_sets == {frozenset(), frozenset({"level", "tags"})}


def test_the_chat_template_renders_prompts_and_the_system_prompt():
    tok = chat_tokenizer()
    plain = tasks.Source("1+1=", None, "2")
    chat = tasks.Source(None, (("system", "mine"), ("user", "2+2=")), "4")
    p = models.Prompts(tok)  # on by default: the tokenizer has one
    assert p.render(plain).prompt == "u:1+1=<a:"
    assert p.ids(p.render(plain).prompt) == tok("u:1+1=<a:", add_special_tokens=False).input_ids  # no BOS added
    s = models.Prompts(tok, system_prompt="be brief")
    assert s.render(plain).prompt == "s:be brief<u:1+1=<a:"
    assert s.render(chat).prompt == "s:mine<u:2+2=<a:"  # the example's own system message wins
    off = models.Prompts(tok, chat_template=False, system_prompt="be brief")
    assert off.render(plain).prompt == "be brief\n1+1="
    assert off.ids("1+1=") == models.prompt_ids(tok, "1+1=")
    with pytest.raises(ValueError, match="chatTemplate: true, but the tokenizer has no chat template"):
        models.Prompts(models.char_tokenizer(), chat_template=True)


def test_without_a_template_a_builtin_prompt_is_what_it_was():
    """The demo's prompts: the char tokenizer has no template, so ids are exactly prompt_ids'."""
    tok = models.char_tokenizer()
    p = models.Prompts(tok)
    for i in range(20):
        ex = tasks.Add(7, p).example(i)
        assert p.ids(ex.prompt) == models.prompt_ids(tok, ex.prompt) and ex.prompt.endswith("=") and not ex.fields


BAD = [
    ("{not json", "not JSON"),
    ("[1, 2]", "a list, not a JSON object"),
    ({"answer": "1"}, "no 'prompt' and no 'messages'"),
    ({"prompt": "1", "messages": [{"role": "user", "content": "1"}], "answer": "1"}, "both 'prompt' and 'messages'"),
    ({"prompt": "1+1="}, "no 'answer'"),
    ({"prompt": "1+1=", "answer": [2]}, "'answer' is a list, not a string or a number"),
    ({"prompt": 12, "answer": "1"}, "'prompt' is int, not a string"),
    ({"messages": [{"role": "system", "content": "x"}], "answer": "1"}, "'messages' has no user message"),
    ({"messages": [{"role": "tool", "content": "x"}], "answer": "1"}, "messages[0]: role 'tool' is not one of"),
    ({"messages": [{"role": "user", "content": 3}], "answer": "1"}, "messages[0] is not a message"),
    ({"messages": [], "answer": "1"}, "'messages' is not a list of messages"),
    ({"prompt": "9" * 40, "answer": "1"}, "its prompt is 41 tokens (task.maxPromptTokens: 32)"),
]


@pytest.mark.parametrize("line, reason", BAD, ids=[r for _, r in BAD])
def test_a_bad_line_is_refused_with_its_line_number_and_reason(tmp_path, line, reason):
    f = tmp_path / "t.jsonl"
    lines(f, {"prompt": "1+1=", "answer": "2"}, line)
    with pytest.raises(ValueError) as e:
        rows(f, max_prompt_tokens=32)
    assert str(e.value).startswith(f"{f}:2: {reason}") and "task.onBadRow: skip" in str(e.value), str(e.value)


def test_bad_lines_can_be_skipped_and_counted(tmp_path):
    f = tmp_path / "t.jsonl"
    lines(f, "{not json", {"prompt": "1+1=", "answer": "2"}, {"answer": "3"}, {"prompt": "2+2=", "answer": "4"})
    t = rows(f, on_bad_row="skip")
    assert sorted(t.example(i).answer for i in range(2)) == ["2", "4"]
    assert t.skipped.startswith(f"skipped 2 bad examples of 4 (task.onBadRow: skip); the first: {f}:1: not JSON")
    lines(f, {"answer": "3"})
    with pytest.raises(ValueError, match=r"no examples \(1 bad, all skipped; the first: .*:1: no 'prompt'"):
        rows(f, on_bad_row="skip")


def test_a_template_that_refuses_an_example_makes_it_a_bad_row(tmp_path):
    tok = models.char_tokenizer()
    tok.chat_template = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}u:"
    f = tmp_path / "t.jsonl"
    two = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    lines(f, {"prompt": "1", "answer": "1"}, {"messages": two, "answer": "1"})
    with pytest.raises(ValueError, match=r"t.jsonl:2: the chat template refused it \(.*one message only\)"):
        rows(f, models.Prompts(tok))


def test_the_rewards_signature_is_checked_against_the_fields_once_at_start(tmp_path):
    (tmp_path / "rw.py").write_text(
        "def narrow(prompt, completion, answer):\n    return 1.0\n"
        "def level(prompt, completion, answer, level=0):\n    return float(level)\n"
        "def two(prompt, completion):\n    return 1.0\n"
    )
    f = tmp_path / "t.jsonl"
    lines(f, {"prompt": "1+1=", "answer": "2", "level": 3}, {"prompt": "1+2=", "answer": "3"})
    t = rows(f)
    tasks.check_reward(tasks.reward_function(f"{tmp_path}/rw.py:level"), "level", t.field_sets)
    tasks.check_reward(tasks.exact, "exact", t.field_sets)  # the built-in rewards take any fields
    with pytest.raises(ValueError, match=r"reward 'narrow' cannot be called .* with the fields level: .*'level'"):
        tasks.check_reward(tasks.reward_function(f"{tmp_path}/rw.py:narrow"), "narrow", t.field_sets)
    with pytest.raises(ValueError, match=r"reward 'two' cannot be called .* no other fields: too many positional"):
        tasks.check_reward(tasks.reward_function(f"{tmp_path}/rw.py:two"), "two", t.field_sets)


def test_builtin_rewards_score_in_this_process_and_count_nothing():
    s = rewards.Scorer("char_match")
    got, failed = s.score([("1+1=", "2", "2", {}), ("1+1=", "3", "2", {"x": 1}), ("", "12", "13", {})])
    assert got == [1.0, 0.0, 0.5] and failed == dict.fromkeys(rewards.FAILURES, 0) and s.pool is None


def test_a_failed_builtin_call_scores_zero_and_is_counted():
    """`call` judges every reward the same way, in a pool process or here."""
    assert rewards.call(tasks.numeric, ("", "3", "3", {})) == ("ok", 1.0)
    assert rewards.call(lambda *a: float("nan"), ("", "", "", {})) == ("nonfinite", "returned nan")
    assert rewards.call(lambda *a: "1", ("", "", "", {}))[0] == "nonnumber"
    assert rewards.call(lambda *a: -1e7, ("", "", "", {})) == ("outofrange", "returned -1e+07, beyond ±1e+06")
    assert rewards.call(lambda *a: -1e6, ("", "", "", {})) == ("ok", -1e6)
    assert rewards.call(lambda *a: 1 / 0, ("", "", "", {})) == ("raised", "ZeroDivisionError: division by zero")
    assert rewards.call(lambda *a, **k: True, ("", "", "", {"x": 1})) == ("ok", 1.0)


# ---------------------------------------------------------------- datasets: local files only


@pytest.fixture
def ds(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # not the user's cache
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # nothing is downloaded
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return datasets


def data_task(spec: dict, prompts=None, **task) -> tasks.Rows:
    t = TaskSpec(dataset=spec, **task)
    what, it = tasks.dataset(t.dataset)
    return tasks.Rows(0, prompts or models.Prompts(models.char_tokenizer()), it, t, what)


ROWS = [
    {"question": "1+1=", "solution": "2", "level": 1},
    {"question": "12+3=", "solution": "15", "level": 2},
]


def test_a_parquet_file_a_jsonl_file_and_a_folder_of_files(ds, tmp_path):
    d = ds.Dataset.from_list(ROWS)
    d.to_parquet(tmp_path / "d.parquet")
    d.to_json(tmp_path / "d.jsonl")
    (tmp_path / "folder").mkdir()
    d.to_parquet(tmp_path / "folder" / "train-0.parquet")
    for path in (tmp_path / "d.parquet", tmp_path / "d.jsonl", tmp_path / "folder"):
        t = data_task({"path": str(path), "promptField": "question", "answerField": "solution"})
        got = sorted((t.example(i).prompt, t.example(i).answer, t.example(i).fields) for i in range(2))
        assert got == [("1+1=", "2", {"level": 1}), ("12+3=", "15", {"level": 2})], path
    t = data_task(
        {
            "path": str(tmp_path / "d.parquet"),
            "split": "train[:1]",
            "promptField": "question",
            "answerField": "solution",
        }
    )
    assert {t.example(i).answer for i in range(3)} == {"2"}  # datasets' slicing


def test_a_saved_data_set_with_splits_and_chat_messages(ds, tmp_path):
    chat = [
        {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "prompt": "unused"},
        {"messages": [{"role": "user", "content": "2+2="}], "answer": "4", "prompt": "unused"},
    ]
    ds.DatasetDict(train=ds.Dataset.from_list(chat), test=ds.Dataset.from_list(chat[:1])).save_to_disk(tmp_path / "s")
    t = data_task(
        {"path": str(tmp_path / "s"), "split": "test", "messagesField": "messages"}, models.Prompts(chat_tokenizer())
    )
    assert t.example(0) == tasks.Example("u:1+1=<a:", "2", {})  # a column named prompt is the reward's own argument
    with pytest.raises(ValueError, match=r"no split 'dev' \(it has train, test\)"):
        data_task({"path": str(tmp_path / "s"), "split": "dev", "messagesField": "messages"})


def test_a_data_sets_missing_column_and_bad_rows_are_named(ds, tmp_path):
    ds.Dataset.from_list(ROWS).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'prompt' \(its columns: question, solution, level\)"):
        data_task({"path": str(tmp_path / "d.parquet"), "answerField": "solution"})
    with pytest.raises(
        ValueError, match=r"d.parquet \[train\] row 1: its prompt is 6 tokens \(task.maxPromptTokens: 5\)"
    ):
        data_task(
            {"path": str(tmp_path / "d.parquet"), "promptField": "question", "answerField": "solution"},
            max_prompt_tokens=5,
        )
    ds.Dataset.from_list([*ROWS, {"question": None, "solution": "1", "level": 3}]).to_parquet(tmp_path / "n.parquet")
    t = data_task(
        {"path": str(tmp_path / "n.parquet"), "promptField": "question", "answerField": "solution"}, on_bad_row="skip"
    )
    assert t.skipped.endswith("n.parquet [train] row 2: no 'question'") and len(t.rows) == 2
    with pytest.raises(ValueError, match=r"dataset no-such/data \[train\]: no such file or folder"):
        data_task({"path": "no-such/data"})  # a name on the hub is read from its download (tests/test_hub.py)
    with pytest.raises(ValueError, match=r"a data file is .parquet, .json, .jsonl, .csv, .arrow"):
        (tmp_path / "d.txt").write_text("x")
        data_task({"path": str(tmp_path / "d.txt")})


@pytest.mark.e2e
def test_datasets_is_imported_only_by_a_job_that_has_one():
    code = (
        "import sys; import sparrowrl.trainer.trainer, sparrowrl.worker.worker, sparrowrl.cli.main; "
        "print('datasets' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr[-2000:]


def test_reward_failures_add_up_in_the_summary_and_in_prometheus():
    from sparrowrl.rollout.coordinator import Coordinator
    from sparrowrl.trainer import reports

    def row(version: int, **failed) -> dict:
        return {
            "version": version,
            "reward_mean": 0.5,
            "tokens": 10,
            "payload_bytes": 1,
            "dense_bytes": 2,
            "changed_fraction": 0.1,
            "reward_failed": {**dict.fromkeys(rewards.FAILURES, 0), **failed},
        }

    rows = [{k: v for k, v in row(1).items() if k != "reward_failed"}, row(2, raised=2), row(3, raised=1, timeout=4)]
    snap = reports.Snapshot(
        job=Coordinator(1, 1, 60.0, 1, 3, "pull").view(),
        steps=3,
        rows=rows,  # the first as written before failures were counted
        seconds=1.0,
        sent={"delta": 0, "base": 0},
        restarts=0,
        redone=0,
        finished=False,
    )
    assert reports.summary(snap)["reward_failed"] == {**dict.fromkeys(rewards.FAILURES, 0), "raised": 3, "timeout": 4}
    (family,) = (m for m in reports.metrics(snap) if m.name == "sparrowrl_reward_failures")
    assert {s.labels["kind"]: s.value for s in family.samples} == {
        **dict.fromkeys(rewards.FAILURES, 0),
        "raised": 3,
        "timeout": 4,
    }

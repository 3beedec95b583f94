"""Abuse from the command line, as a careless or hostile user would try it: every case is
refused with one line naming the problem, and nothing that was there before is lost. Each
command runs in a child under an address-space limit and a deadline (tests/support/bounded.py);
the commands of one case may share one child."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import zstd_frame
from safetensors.torch import save_file
from support import jobs
from support.bounded import limit_memory, refused, sparrowrl, sparrowrl_each

from sparrowrl.cli import runner
from sparrowrl.spec.job import JobError, parse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.usefixtures("address_space_limit")]

BILLION_LAUGHS = (
    """\
apiVersion: sparrowrl.dev/v1alpha1
kind: SparrowRLJob
metadata:
  name: x
  annotations: &a0 {a: lol}
  labels:
"""
    + "".join(f"    a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
    + """\
spec: {model: {tiny: {}}, task: {builtin: add}}
"""
)


def job(**spec) -> dict:
    return jobs.job(**{"steps": 1, **spec})


def write_job(path, **spec):
    path.write_text(yaml.safe_dump(job(**spec)))
    return path


def here(*args):
    """The CLI in this process (typer's runner), for the commands a case runs after the refused
    one, to show that what was refused left everything working: each start of the CLI as a
    process imports torch again (seconds)."""
    from typer.testing import CliRunner

    from sparrowrl.cli.main import app

    return CliRunner().invoke(app, list(map(str, args)), catch_exceptions=False)


def tree(path) -> dict:
    """Every file under `path` with its bytes: what must survive a refused command."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- run dirs: never delete what we did not write


def user_files(d):
    (d / "model").mkdir(parents=True)
    (d / "logs").mkdir()
    (d / "model" / "weights.bin").write_bytes(b"precious")
    (d / "logs" / "today.log").write_text("mine")
    (d / "summary.json").write_text('{"mine": true}')
    return tree(d)


def test_a_bad_job_touches_no_file_of_the_run_dir(tmp_path):
    """Even a previous run's folder, given to be replaced: the job is checked before anything goes."""
    user_files(tmp_path / "d")
    (tmp_path / "d" / runner.MARK).write_text("{}")
    before = tree(tmp_path / "d")
    f = write_job(tmp_path / "j.yaml", model={"path": "no-such-model"})
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "d", "--overwrite"), "spec.model.path", "is not a folder")
    assert tree(tmp_path / "d") == before


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_folder_that_is_not_a_run_is_refused_even_with_overwrite(tmp_path, flags):
    before = user_files(tmp_path / "d")
    f = write_job(tmp_path / "j.yaml")
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "d", *flags), "not empty, and not a previous run's folder")
    assert tree(tmp_path / "d") == before
    (tmp_path / "file").write_text("x")
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "file", *flags), "not a folder")
    assert (tmp_path / "file").read_text() == "x"


def test_a_previous_run_is_replaced_only_with_overwrite_and_only_what_a_run_writes(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / runner.MARK).write_text("{}")
    for name in ("summary.json", "metrics.jsonl"):
        (d / name).write_text("old")
    (d / "store").mkdir()
    (d / "store" / "x").write_text("old")
    (d / "notes.txt").write_text("the user's")
    f = write_job(tmp_path / "j.yaml")
    refused(sparrowrl("run", f, "--run-dir", d), "holds a previous run's results; --overwrite replaces them")
    assert (d / "summary.json").read_text() == "old"

    runner.claim_run_dir(d, parse(job()), overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == [runner.MARK, "notes.txt"]
    assert (d / "notes.txt").read_text() == "the user's"


def test_a_run_dir_made_before_the_mark_is_a_previous_run(tmp_path):
    d = tmp_path / "legacy"
    (d / "store").mkdir(parents=True)
    for name in ("job.yaml", "summary.json", "metrics.jsonl"):
        (d / name).write_text("old")
    f = write_job(tmp_path / "j.yaml")
    refused(sparrowrl("run", f, "--run-dir", d), "holds a previous run's results; --overwrite replaces them")
    runner.claim_run_dir(d, parse(job()), overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == [runner.MARK]


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(runner.RunError, match="--run-dir .*file/sub: Not a directory"):
        runner.claim_run_dir(tmp_path / "file" / "sub", parse(job()), overwrite=False)
    assert (tmp_path / "file").read_text() == "x"


# ---------------------------------------------------------------- the job file and what it names


def test_yaml_alias_expansion_is_bounded(tmp_path):
    f = tmp_path / "laughs.yaml"
    f.write_text(BILLION_LAUGHS)
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "r", timeout=60), "more than 100,000 YAML values")
    f.write_text("a: &a [*a]\n")  # an alias of itself: endless once expanded
    refused(sparrowrl("run", f, timeout=60), "more than 100,000 YAML values")
    assert not (tmp_path / "r").exists()


def test_job_and_task_files_are_bounded_and_regular(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20))
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.jsonl", "wb") as fh:
        fh.truncate(300 << 20)  # sparse: no disk used
    cases = [(["run", big], ["a job file is 2,097,154 bytes (limit 1,048,576)"])]
    cases.append((["run", tmp_path / "fifo"], ["a job file must be a regular file"]))
    for jsonl, reason in (
        (tmp_path / "fifo", "must be a regular file"),
        ("/dev/zero", "must be a regular file"),
        (tmp_path / "huge.jsonl", "(limit 268,435,456)"),
    ):
        f = write_job(tmp_path / f"j{len(cases)}.yaml", task={"jsonl": str(jsonl)})
        cases.append((["run", f, "--run-dir", tmp_path / "r"], ["spec.task", reason]))
    for p, (_, words) in zip(sparrowrl_each(*(c for c, _ in cases)), cases, strict=True):
        refused(p, *words)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "spec, field, reason",
    [
        ({"grpo": {"weightDecay": float("inf")}}, "spec.grpo.weightDecay", "finite number"),
        ({"grpo": {"learningRate": float("nan")}}, "spec.grpo.learningRate", "finite number"),
        ({"grpo": {"weightDecay": 2.0}}, "spec.grpo.weightDecay", "less than or equal to 1"),
        ({"grpo": {"temperature": 1e-300}}, "spec.grpo.temperature", "greater than or equal to 0.01"),
        ({"grpo": {"promptsPerStep": 10**9}}, "spec.grpo.promptsPerStep", "less than or equal to 4096"),
        ({"rollout": {"leaseSeconds": float("inf")}}, "spec.rollout.leaseSeconds", "finite number"),
        ({"seed": 2**64}, "spec.seed", "less than or equal to"),
        ({"seed": -1}, "spec.seed", "greater than or equal to 0"),
        ({"steps": 10**12}, "spec.steps", "less than or equal to 10000000"),
        ({"sync": {"baseEvery": 10**9}}, "spec.sync.baseEvery", "less than or equal to 1000000"),
        (
            {"topology": {"regions": [{"name": "a", "bandwidthMbit": float("inf")}]}},
            "spec.topology.regions.0.bandwidthMbit",
            "finite number",
        ),
        (
            {"topology": {"regions": [{"name": f"r{i}"} for i in range(65)]}},
            "spec.topology.regions",
            "at most 64 items",
        ),
        (
            {"task": {"builtin": "add", "reward": "os:system;rm"}},
            "spec.task.reward",
            "is not exact, numeric, char_match",
        ),
        ({"task": {"builtin": "add", "reward": "pkg.mod:f"}}, "spec.task.reward", "module:function (module.py beside"),
        (
            {"grpo": {"groupSize": 256, "maxNewTokens": 4096}, "rollout": {"groupsPerLease": 8}},
            "spec",
            "8,388,608 tokens per lease (limit 4,194,304)",
        ),
    ],
)
def test_every_number_is_finite_and_bounded(spec, field, reason):
    with pytest.raises(JobError) as e:
        parse(job(**spec))
    assert f"{field}: " in str(e.value) and reason in str(e.value), str(e.value)


def test_a_non_finite_number_in_yaml_is_refused_from_the_command_line(tmp_path):
    """1e400 reads as inf; the run used to end with rc 0 and every final tensor NaN."""
    f = tmp_path / "j.yaml"
    f.write_text(yaml.safe_dump(job()).replace("steps: 1", "steps: 1\n  grpo: {weightDecay: 1e400}"))
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "r"), "spec.grpo.weightDecay: Input should be a finite number")
    refused(sparrowrl("run", write_job(tmp_path / "k.yaml"), "--steps", "100000000000"), "spec.steps")


@pytest.mark.parametrize(
    "meta, reason",
    [
        ({"name": "t", "nickname": "x"}, "metadata.nickname: unknown field"),
        ({"name": "t", "finalizers": ["x"] * 65}, "metadata.finalizers: List should have at most 64 items"),
        ({"name": "t", "labels": {"a": "x" * 64}}, "is not 63 characters at most"),
        ({"name": "t", "labels": {"bad key!": "x"}}, "label key 'bad key!'"),
        ({"name": "t", "labels": {"a": ["nested"]}}, "metadata.labels.a: Input should be a valid string"),
        ({"name": "t", "annotations": {"a": "x" * (300 << 10)}}, "Kubernetes allows 262,144"),
        ({"name": "t", "namespace": "Not_A_Namespace"}, "metadata.namespace"),
    ],
)
def test_metadata_is_what_kubernetes_allows(meta, reason):
    with pytest.raises(JobError, match=reason.replace(".", r"\.").replace("(", r"\(")):
        parse({**job(), "metadata": meta})


def test_a_reward_names_a_file_beside_the_job_never_an_installed_callable(tmp_path):
    f = write_job(tmp_path / "j.yaml", task={"builtin": "add", "reward": "os:system"})
    refused(sparrowrl("run", f, "--run-dir", tmp_path / "r"), "spec.task: reward", "no file", "os.py")
    assert not (tmp_path / "r").exists()


def test_a_file_beside_the_job_does_not_shadow_the_standard_library(tmp_path):
    """tabnanny: a standard module that nothing has imported before the reward does."""
    (tmp_path / "tabnanny.py").write_text(f"open({str(tmp_path / 'shadowed')!r}, 'w').close()\n")
    (tmp_path / "rw.py").write_text(
        "import tabnanny\nimport helper\n"
        "def f(prompt, completion, answer):\n"
        "    return float(hasattr(tabnanny, 'check')) * helper.ONE\n"
    )
    (tmp_path / "helper.py").write_text("ONE = 1.0\n")  # the reward's own module, beside it
    code = (
        "import sys; from sparrowrl.spec.job import load; from sparrowrl.trainer import models; "
        "from sparrowrl.trainer.tasks import for_job, reward_function; "
        "assert 'tabnanny' not in sys.modules; "
        f"_, name = for_job(load({str(tmp_path / 'j.yaml')!r}).spec, models.Prompts(models.char_tokenizer())); "
        "import tabnanny; print(reward_function(name)('', '', ''), tabnanny.__file__)"
    )
    write_job(tmp_path / "j.yaml", task={"builtin": "add", "reward": "rw:f"})
    p = subprocess.run(
        [sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        preexec_fn=limit_memory,
    )
    assert p.returncode == 0, p.stderr
    value, where = p.stdout.split()
    assert value == "1.0" and not where.startswith(str(tmp_path))
    assert not (tmp_path / "shadowed").exists()


# ---------------------------------------------------------------- stores: a bad version is refused, nothing lost


def v0() -> dict:
    return {"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5)}


@pytest.fixture(scope="module")
def made_store(tmp_path_factory):
    """`sparrowrl store init` of v0, once: each start of the CLI imports torch again (seconds)."""
    d = tmp_path_factory.mktemp("store")
    save_file(v0(), d / "v0.safetensors")
    assert sparrowrl("store", "init", d / "s", d / "v0.safetensors").returncode == 0
    return d


@pytest.fixture
def store(made_store, tmp_path):
    """A copy of that store and its v0 in this test's folder, which the test may change."""
    shutil.copytree(made_store / "s", tmp_path / "s")
    shutil.copy(made_store / "v0.safetensors", tmp_path)
    return tmp_path / "s", v0()


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda t: {"a": t["a"]}, ["lacks tensor 'b', which v0 has"]),
        (lambda t: {**t, "c": torch.ones(1)}, ["has tensor 'c', which v0 does not"]),
        (lambda t: {"a": t["a"], "B": t["b"]}, ["has tensor 'B', which v0 does not"]),
        (lambda t: {**t, "b": torch.ones(6)}, ["tensor 'b' is F32[6] in the new version, F32[5] in v0"]),
        (lambda t: {**t, "a": t["a"].float()}, ["tensor 'a' is F32[3, 4] in the new version, BF16[3, 4] in v0"]),
    ],
)
def test_store_add_refuses_another_tensor_table_and_the_store_stays_whole(store, tmp_path, change, words):
    path, t = store
    save_file(change(t), tmp_path / "bad.safetensors")
    before = tree(path)
    refused(sparrowrl("store", "add", path, tmp_path / "bad.safetensors"), *words)
    assert {k: v for k, v in tree(path).items() if k != ".lock"} == before  # .lock: the writers' lock
    save_file({**t, "b": t["b"] * 2}, tmp_path / "v1.safetensors")  # and takes the next version as before
    p = here("store", "add", path, tmp_path / "v1.safetensors")
    assert p.exit_code == 0 and p.stdout.strip() == "1", p.stderr
    assert here("store", "materialize", path, "1", "-o", tmp_path / "out.safetensors").exit_code == 0


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda d: d["versions"][0].update(base="../../../etc/passwd"),
            ["base '../../../etc/passwd' is not the store's name"],
        ),
        (lambda d: d["versions"][0].update(base="/etc/passwd"), ["base '/etc/passwd'"]),
        (lambda d: d.update(base_every=0), ["base_every 0 is not 1..1,000,000"]),
        (lambda d: d.update(versions=[]), ["no versions"]),
        (lambda d: d["versions"][0].update(version=1.5), ["version 1.5: not a version number"]),
        (lambda d: d["versions"][0].update(base_bytes=-1), ["base_bytes -1 is not a count"]),
        (lambda d: d["versions"][0].update(base_part_bytes=3 << 16), ["its parts do not fit its size"]),
        (lambda d: d["versions"][0].update(base_part_bytes=1 << 40), ["its parts do not fit its size"]),
    ],
)
def test_an_index_that_names_files_outside_the_store_or_impossible_numbers_is_refused(store, edit, words):
    path, _ = store
    index = json.loads((path / "store.json").read_text())
    edit(index)
    (path / "store.json").write_text(json.dumps(index))
    refused(sparrowrl("store", "materialize", path, "0", "-o", path.parent / "o.safetensors"), "damaged index", *words)
    assert not (path.parent / "o.safetensors").exists()


def test_store_init_refuses_base_every_out_of_range(tmp_path, store):
    for k in ("0", "-3", "2000000"):
        refused(
            sparrowrl("store", "init", tmp_path / "n", tmp_path / "v0.safetensors", "--base-every", k),
            "base_every must be 1..1,000,000",
        )
    assert not (tmp_path / "n").exists()


# ---------------------------------------------------------------- outputs: never replace what is not a regular file


def specials(tmp_path) -> dict:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "keep").write_text("x")
    out = {"fifo": tmp_path / "fifo", "folder": tmp_path / "folder"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "chardev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null
        out["chardev"] = tmp_path / "chardev"
    return out


def unchanged(path, kind) -> bool:
    mode = os.lstat(path).st_mode
    return {"fifo": stat.S_ISFIFO, "chardev": stat.S_ISCHR, "folder": stat.S_ISDIR}[kind](mode)


def test_outputs_that_are_not_regular_files_are_never_replaced(store, tmp_path):
    path, t = store
    save_file({**t, "b": t["b"] * 3}, tmp_path / "v1.safetensors")
    assert (
        sparrowrl(
            "delta", "diff", tmp_path / "v0.safetensors", tmp_path / "v1.safetensors", "-o", tmp_path / "d.spd"
        ).returncode
        == 0
    )
    cases = [
        (kind, out, args)
        for kind, out in specials(tmp_path).items()
        for args in (
            ["delta", "diff", tmp_path / "v0.safetensors", tmp_path / "v1.safetensors", "-o", out],
            ["delta", "apply", tmp_path / "v0.safetensors", tmp_path / "d.spd", "-o", out],
            ["store", "materialize", path, "0", "-o", out],
        )
    ]
    for p, (kind, out, args) in zip(sparrowrl_each(*(args for _, _, args in cases), timeout=180), cases, strict=True):
        refused(p, str(out), "not replaced")
        assert unchanged(out, kind), (kind, args)
    assert (tmp_path / "folder" / "keep").read_text() == "x"


def test_a_folder_output_is_replaced_only_by_a_checkpoint_of_the_same_files(tmp_path):
    t = {"w": torch.ones(4, dtype=torch.bfloat16)}
    (tmp_path / "base").mkdir()
    save_file(t, tmp_path / "base" / "model.safetensors")
    (tmp_path / "base" / "config.json").write_text("{}")
    save_file({"w": t["w"] * 2}, tmp_path / "new.safetensors")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("years of work")
    shutil.copytree(tmp_path / "home", tmp_path / "home2")
    save_file(t, tmp_path / "home2" / "downloaded.safetensors")  # a checkpoint among other files is still theirs
    made, *applied = sparrowrl_each(
        [
            "delta",
            "diff",
            tmp_path / "base" / "model.safetensors",
            tmp_path / "new.safetensors",
            "-o",
            tmp_path / "d.spd",
        ],
        *(
            ["delta", "apply", tmp_path / "base", tmp_path / "d.spd", "-o", tmp_path / o]
            for o in ("home", "home2", "out", "out")
        ),
    )
    assert made.returncode == 0, made.stderr
    refused(applied[0], "holds 'thesis.tex', which this checkpoint does not; not replaced")
    refused(applied[1], "holds 'downloaded.safetensors', which this checkpoint does not")
    assert [p.name for p in (tmp_path / "home").iterdir()] == ["thesis.tex"]
    assert sorted(p.name for p in (tmp_path / "home2").iterdir()) == ["downloaded.safetensors", "thesis.tex"]
    assert applied[2].returncode == 0 and applied[3].returncode == 0, (applied[2].stderr, applied[3].stderr)


def test_a_symlinked_output_is_written_through(store, tmp_path):
    path, _ = store
    (tmp_path / "real.safetensors").write_text("old")
    (tmp_path / "link").symlink_to(tmp_path / "real.safetensors")
    assert sparrowrl("store", "materialize", path, "0", "-o", tmp_path / "link").returncode == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real.safetensors").read_bytes() != b"old"


def test_fifos_given_as_files_and_a_missing_ca_file_are_named(tmp_path, store):
    (tmp_path / "ck").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "ck" / "a.safetensors")
    os.mkfifo(tmp_path / "ck" / "b.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "new.safetensors")
    os.mkfifo(tmp_path / "cert.pem")
    pem = tmp_path / "cert.pem"
    diff, fetch, serve = sparrowrl_each(
        ["delta", "diff", tmp_path / "ck", tmp_path / "new.safetensors", "-o", tmp_path / "d.spd"],
        ["fetch", "https://127.0.0.1:9", "--version", "0", "-o", tmp_path / "o.safetensors"]
        + ["--ca-cert", tmp_path / "none.pem"],
        ["serve", store[0], "--port", "9", "--tls-cert", pem, "--tls-key", pem],
    )
    refused(diff, "b.safetensors: not a regular file")
    refused(fetch, "--ca-cert", "none.pem")
    refused(serve, "--tls-cert", "a PEM file must be a regular file")


# ---------------------------------------------------------------- inputs read whole


def test_a_delta_that_is_endless_or_larger_than_memory_is_refused_before_reading(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.spd", "wb") as f:
        f.truncate(1 << 40)  # sparse: no disk used, and more than this machine's memory
    zero, fifo, huge = sparrowrl_each(
        *(["delta", "inspect", d] for d in ("/dev/zero", tmp_path / "fifo", tmp_path / "huge.spd"))
    )
    refused(zero, "a delta must be a regular file")
    refused(fifo, "a delta must be a regular file")
    refused(huge, "a delta is 1,099,511,627,776 bytes (limit")


def test_a_packed_header_too_large_to_parse_in_the_memory_free_is_refused_unread(tmp_path):
    """A 14-byte zstd frame may declare 60 MiB of header JSON, which takes up to 16x that to
    validate: with 512 MiB free the delta is refused before anything is unpacked, and says why
    (with 2 GiB free the same frame gets as far as unpacking, and fails there)."""
    import hashlib
    import resource

    from support.bounded import BASELINE, EXE

    from sparrowrl.delta.frame import HEAD, MAGIC, TRAILER

    frame = zstd_frame(60 << 20, b"{}")
    path = tmp_path / "d.spd"
    path.write_bytes(HEAD.pack(MAGIC, 3, len(frame)) + frame + hashlib.sha256(frame).digest() + bytes(TRAILER.size))
    room = BASELINE + (512 << 20)
    p = subprocess.run(
        [str(EXE), "delta", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (room, room)),
    )
    refused(
        p,
        f"{path}: header: does not unpack: declares {60 << 20} bytes unpacked, more than the memory free "
        "here can parse",
    )
    assert "more than the memory" not in refused(
        sparrowrl("delta", "inspect", path, timeout=60), "header: does not unpack"
    )


def test_a_relay_cache_that_holds_other_files_is_refused(tmp_path):
    """A relay deletes old versions in its cache: a folder of the user's is never one; a cache
    made before the mark still is one."""
    from sparrowrl.transport.relay import Relay

    d = tmp_path / "home"
    (d / "deltas").mkdir(parents=True)
    (d / "deltas" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for cache in (d, tmp_path / "file"):
        refused(
            sparrowrl("relay", "--upstream", "http://127.0.0.1:9", "--cache", cache, "--port", "9", timeout=60),
            "not empty, and not a relay's cache",
        )
    assert tree(d) == {"deltas/notes.txt": b"mine"} and (tmp_path / "file").read_text() == "x"
    old = tmp_path / "old"
    (old / "deltas").mkdir(parents=True)
    (old / "bases").mkdir()
    (old / "store.json").write_text("{}")
    (old / "deltas" / "v00000001-0123456789abcdef.spd").write_bytes(b"")
    (old / "deltas" / ".v00000002.partial").write_bytes(b"")
    Relay(["http://127.0.0.1:9"], old)
    assert (old / ".sparrowrl-relay").exists() and not (old / "deltas" / ".v00000002.partial").exists()


def test_a_server_refuses_an_index_that_points_outside_the_store(store):
    import urllib.error
    import urllib.request

    from support.bounded import TOKEN, serving

    path, _ = store
    with serving("serve", path) as (_, port):
        index = json.loads((path / "store.json").read_text())
        index["versions"][0]["base"] = "../../../../etc/passwd"  # changed while it serves
        (path / "store.json").write_text(json.dumps(index))
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/versions/0/base", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 503 and "damaged index" in e.value.read().decode()

"""The command line on real files: as real processes, and in this process (typer's runner) where a
test runs many commands: each start of the command imports torch again (seconds)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from support import jobs
from support.tensors import mutate, random_tensor, same

EXE = Path(sys.executable).parent / "sparrowrl"


def run(*args, ok=True):
    p = subprocess.run([str(EXE), *map(str, args)], capture_output=True, text=True, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def here(*args, ok=True) -> subprocess.CompletedProcess:
    """`run`, with the command in this process."""
    from typer.testing import CliRunner

    from sparrowrl.cli.main import app

    r = CliRunner().invoke(app, list(map(str, args)), catch_exceptions=False)
    p = subprocess.CompletedProcess(["sparrowrl", *map(str, args)], r.exit_code, r.stdout, r.stderr)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def same_file(a: Path, b: Path) -> bool:
    return same(load_file(str(a)), load_file(str(b)))


@pytest.fixture
def files(rng, tmp_path):
    old = {
        "model.embed.weight": random_tensor(rng, "BF16", (500, 64)),
        "model.norm.weight": random_tensor(rng, "F32", (64,)),
    }
    new = {k: mutate(rng, v, 0.01) for k, v in old.items()}
    save_file(old, tmp_path / "old.safetensors", metadata={"format": "pt"})
    save_file(new, tmp_path / "new.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.e2e
def test_diff_apply_inspect(files):
    run("delta", "diff", files / "old.safetensors", files / "new.safetensors", "-o", files / "d.spd")
    run("delta", "apply", files / "old.safetensors", files / "d.spd", "-o", files / "out.safetensors")
    assert same_file(files / "out.safetensors", files / "new.safetensors")
    info = json.loads(run("delta", "inspect", files / "d.spd", "--json").stdout)
    for key in (
        "base_version",
        "target_version",
        "base_hash",
        "target_hash",
        "tensors",
        "elements",
        "changed",
        "payload_bytes",
        "dense_bytes",
        "bytes_per_changed",
    ):
        assert key in info
    assert info["elements"] == 500 * 64 + 64 and info["payload_bytes"] == (files / "d.spd").stat().st_size
    assert "changed" in run("delta", "inspect", files / "d.spd").stdout


def test_apply_refuses_and_writes_nothing(files):
    here("delta", "diff", files / "old.safetensors", files / "new.safetensors", "-o", files / "d.spd")
    data = bytearray((files / "d.spd").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (files / "bad.spd").write_bytes(bytes(data))
    p = here("delta", "apply", files / "old.safetensors", files / "bad.spd", "-o", files / "out.safetensors", ok=False)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "checksum mismatch" in p.stderr
    assert not (files / "out.safetensors").exists()
    assert [f.name for f in files.iterdir() if f.name.startswith(".")] == []  # no temp leftovers
    # wrong base: applying to NEW instead of OLD
    p = here("delta", "apply", files / "new.safetensors", files / "d.spd", "-o", files / "out.safetensors", ok=False)
    assert p.returncode == 1 and "base hash mismatch" in p.stderr and not (files / "out.safetensors").exists()


@pytest.mark.e2e
def test_diff_refuses_mismatched_shapes(files, rng):
    save_file(
        {
            "model.embed.weight": random_tensor(rng, "BF16", (64, 500)),
            "model.norm.weight": random_tensor(rng, "F32", (64,)),
        },
        files / "other.safetensors",
    )
    p = run("delta", "diff", files / "old.safetensors", files / "other.safetensors", "-o", files / "d.spd", ok=False)
    assert p.returncode == 1 and "model.embed.weight" in p.stderr and "BF16[500, 64]" in p.stderr
    assert not (files / "d.spd").exists()


def test_shard_folders(rng, tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
    shards = [{"a": random_tensor(rng, "BF16", (100, 10))}, {"b": random_tensor(rng, "BF16", (30,))}]
    for i, s in enumerate(shards):
        save_file(s, old / f"model-0000{i + 1}-of-00002.safetensors")
        save_file({k: mutate(rng, v, 0.1) for k, v in s.items()}, new / f"model-0000{i + 1}-of-00002.safetensors")
    (old / "config.json").write_text('{"model_type": "tiny"}')
    # the same tensors in another layout (one file, other order) diff against the folder
    from safetensors.torch import load_file as lf

    merged = {**lf(str(old / "model-00002-of-00002.safetensors")), **lf(str(old / "model-00001-of-00002.safetensors"))}
    save_file(merged, tmp_path / "merged.safetensors")
    here("delta", "diff", tmp_path / "merged.safetensors", new, "-o", tmp_path / "m.spd")
    here("delta", "diff", old, new, "-o", tmp_path / "d.spd")
    here("delta", "apply", old, tmp_path / "d.spd", "-o", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "tiny"}'
    for f in sorted(new.glob("*.safetensors")):
        assert same_file(tmp_path / "out" / f.name, f)


def test_store_commands(files, rng):
    store = files / "store"
    here("store", "init", store, files / "old.safetensors", "--base-every", "2")
    prev = files / "new.safetensors"
    assert here("store", "add", store, prev).stdout.strip() == "1"
    state = load_file(str(prev))
    for v in (2, 3):
        state = {k: mutate(rng, t, 0.01) for k, t in state.items()}
        save_file(state, files / f"v{v}.safetensors")
        assert here("store", "add", store, files / f"v{v}.safetensors").stdout.strip() == str(v)
    here("store", "materialize", store, 3, "-o", files / "m3.safetensors")
    assert same_file(files / "m3.safetensors", files / "v3.safetensors")
    listing = json.loads(here("store", "ls", store, "--json").stdout)
    assert [v["version"] for v in listing] == [0, 1, 2, 3] and listing[2]["base"]
    assert "state hash" in here("store", "ls", store).stdout
    plan = json.loads(here("store", "plan", store, "--from", "1", "--to", "3").stdout)
    assert (plan["route"], plan["deltas"]) == ("chain", [2, 3])  # two 1% deltas are less than a base
    plan = json.loads(here("store", "plan", store, "--to", "3").stdout)
    assert (plan["route"], plan["base"], plan["deltas"]) == ("base", 2, [3])  # from nothing: the nearest base
    here("store", "prune", store, "--keep", "1")
    assert [v["version"] for v in json.loads(here("store", "ls", store, "--json").stdout)] == [2, 3]
    p = here("store", "materialize", store, 0, "-o", files / "m0.safetensors", ok=False)
    assert p.returncode == 1 and "version 0 is not in the store" in p.stderr


def test_check_names_what_the_trainer_would_not_find(tmp_path, monkeypatch):
    """`sparrowrl check`, the trainer pod's init container: exit 3 and one line naming the field
    and the path when the job cannot run, 0 when it can. A model still to be downloaded from the
    hub is not asked for (the address is dead here); its data and reward are checked all the same.
    In this process (typer's runner): each start of the command would import torch again."""
    import yaml
    from typer.testing import CliRunner

    from sparrowrl.cli.main import app

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def check(model, **task):
        job = {"apiVersion": "sparrowrl.dev/v1alpha1", "kind": "SparrowRLJob", "metadata": {"name": "c"}}
        job["spec"] = {"model": model, "task": task}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        return CliRunner().invoke(app, ["check", str(tmp_path / "job.yaml"), "--state-dir", str(tmp_path / "state")])

    hub = {"hub": {"repo": "me/model"}}
    p = check(jobs.tiny(), builtin="add", reward="inputs/score.py:score")
    assert p.exit_code == 3, p.output
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path}/job.yaml: spec.task: reward ")
    assert f"no file {tmp_path}/inputs/score.py" in p.stderr
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "score.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    p = check(hub, jsonl="inputs/data.jsonl", reward="inputs/score.py:score")
    assert p.exit_code == 3 and f"{tmp_path}/inputs/data.jsonl" in p.stderr, p.output
    (tmp_path / "inputs" / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2", "level": 1}) + "\n")
    p = check(hub, jsonl="inputs/data.jsonl", reward="inputs/score.py:score")
    assert p.exit_code == 3 and "the fields level" in p.stderr, p.output  # the data's field, before any model
    (tmp_path / "inputs" / "score.py").write_text("def score(prompt, completion, answer, **fields):\n    return 1.0\n")
    p = check(hub, jsonl="inputs/data.jsonl", reward="inputs/score.py:score")
    assert p.exit_code == 0 and "load here" in p.stdout, p.output
    assert not (tmp_path / "state").exists()  # it writes nothing
    # a state dir (a claim kept from an earlier job of the name) of another job: refused here, not in a crash loop
    from sparrowrl.spec.job import load

    mine = load(tmp_path / "job.yaml").spec.model_dump(mode="json")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "job.json").write_text(json.dumps(mine | {"seed": mine["seed"] + 1}))
    p = check(hub, jsonl="inputs/data.jsonl", reward="inputs/score.py:score")
    assert p.exit_code == 3 and "holds the state of another job (spec.seed differs)" in p.stderr, p.output
    (tmp_path / "state" / "job.json").write_text(json.dumps(mine))  # its own: the trainer resumes from it
    assert check(hub, jsonl="inputs/data.jsonl", reward="inputs/score.py:score").exit_code == 0


def test_status_of_a_path_that_is_no_run_dir_or_of_an_ended_run_is_one_line(tmp_path):
    """`sparrowrl status RUN_DIR`: a path that is neither a run dir nor a URL, and a run whose
    trainer is gone after writing its summary, say so in one line (urllib's "unknown url type"
    came with a traceback; a refused connection named only the trainer's old port)."""
    import socket

    missing, file = tmp_path / "runs" / "demo", tmp_path / "notes.txt"
    file.write_text("x")
    for path, what in ((missing, "no such run dir"), (file, "not a run dir (a folder)")):
        p = here("status", path, ok=False)
        assert p.returncode == 1 and p.stderr == f"error: {path}: {what}, and not a URL (http://HOST:PORT)\n"
    p = here("status", "http://127.0.0.1:abc", ok=False)
    assert (
        p.returncode == 1
        and p.stderr == "error: http://127.0.0.1:abc: not a URL http://HOST:PORT (nonnumeric port: 'abc')\n"
    )

    ended = tmp_path / "run"  # what a `sparrowrl run` leaves (cli/runner.py): its trainer's port is closed
    ended.mkdir()
    with socket.socket() as closed:  # bound, not listening: a connection is refused, and no one else takes it
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        (ended / "token").write_text("secret\n")
        gone = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below it: no process has it

        def trainer(pid: int) -> None:
            (ended / "processes.json").write_text(
                json.dumps({"trainer": pid, "relays": {}, "workers": {}, "urls": {"trainer": url}})
            )

        trainer(gone)
        p = here("status", ended, ok=False)
        assert p.returncode == 1 and p.stderr == (  # stopped: killed, or its runner was
            f"error: {ended}: the run stopped before its end (its trainer at {url} does not answer); "
            f"`sparrowrl run JOB --run-dir {ended} --resume` goes on from where it stopped\n"
        )
        trainer(os.getpid())  # alive (its runner starting it again after a crash): not said to have stopped
        p = here("status", ended, ok=False)
        assert p.returncode == 1 and p.stderr == f"error: {url}/v1/status: [Errno 111] Connection refused\n"
        trainer(gone)
        (ended / "summary.json").write_text("{}")
        p = here("status", ended, ok=False)
        assert p.returncode == 1
        assert p.stderr == f"error: {ended}: the run has ended; its results are in {ended}/summary.json\n"
        (ended / "processes.json").unlink()  # a run dir that lost it: its summary says the same
        p = here("status", ended, ok=False)
        assert p.stderr == f"error: {ended}: the run has ended; its results are in {ended}/summary.json\n"


ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_lists_every_command_and_every_option_of_run():
    """The README's command list is where a user looks first: a command, or a way to run a job,
    that is not there is one they do not find."""
    from typer.main import get_command

    from sparrowrl.cli.main import app

    block = re.search(r"\n## Command line\n+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    lines = block.splitlines()
    top = get_command(app)
    for name, cmd in top.commands.items():
        for path in [f"{name} {sub}" for sub in cmd.commands] if hasattr(cmd, "commands") else [name]:
            assert any(line.startswith(f"sparrowrl {path} ") for line in lines), f"sparrowrl {path}"
    run = " ".join(line for line in lines if line.startswith("sparrowrl run "))
    for opt in (p for p in top.commands["run"].params if p.param_type_name == "option"):
        assert all(o in run for o in opt.opts), opt.opts


def test_the_limits_name_every_kind_of_weights_file_a_model_folder_may_hold():
    from sparrowrl.trainer.models import WEIGHTS

    row = next(line for line in (ROOT / "docs/limits.md").read_text().splitlines() if line.startswith("| `model.path`"))
    for pattern in WEIGHTS:
        assert f"`{pattern}`" in row or pattern in row, pattern

"""The standard vLLM server with SparrowRL's weight-transfer backend, in the `make test-vllm` venv.

A plain torch loop publishes versions with the public sync API (`Publisher`, served by an
`Origin`); the server (`--weight-transfer-config '{"backend": "sparrowrl"}'`, dev mode's routes)
is driven through pause, start, update, finish and resume for most of them, and once for two
versions at once. The backend's hash of the weights it reads back out of vLLM must be the
trainer's state hash, `/weight_info` must name the version, and greedy text must change with the
weights. An origin without the trainer's key is refused: the update fails and nothing served
changes. The backend's Prometheus metrics reach `/metrics`."""

import copy
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")

from support.models import decisive_qwen3  # noqa: E402
from support.servers import TOKEN  # noqa: E402
from support.vllm_serve import vllm_serve  # noqa: E402

from sparrowrl.delta import state_hash  # noqa: E402
from sparrowrl.delta.tensors import TensorSpec  # noqa: E402
from sparrowrl.store.store import Store  # noqa: E402
from sparrowrl.sync import Origin, Publisher  # noqa: E402
from sparrowrl.trainer.models import policy_state  # noqa: E402

pytestmark = pytest.mark.e2e

N = 4  # versions published before the forger's
UPDATES = (1, 2, 4)  # the versions the server is told to serve: v2 to v4 applies v3 and v4 at once
PROMPT = "abcde"


def forge(store: Store, old: dict, new: dict) -> None:
    """A forger's version: its bf16 policy diffed against the last one, into its own store."""
    with store.publish([TensorSpec.of(n, t) for n, t in new.items()]) as w:
        w.add((n, old[n], new[n]) for n in new)


def step(model, opt, gen) -> None:
    """One AdamW step of a plain torch loop."""
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


class Server:
    """HTTP calls to the vLLM server."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model

    def call(self, path: str, body: dict | None = None, method: str = "POST", timeout: float = 180):
        data = None if method == "GET" else json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ok(self, path: str, body: dict | None = None, method: str = "POST"):
        status, answer = self.call(path, body, method)
        assert status == 200, (path, status, answer)
        return answer

    def status(self) -> dict:
        (s,) = self.ok("/collective_rpc", {"method": "sparrowrl_status"})["results"]
        return s

    def version(self) -> str:
        return self.ok("/weight_info", method="GET")["weight_version"]

    def greedy(self) -> str:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        return self.ok("/v1/completions", body)["choices"][0]["text"]

    def update(self, version: int) -> tuple[int, object]:
        """The trainer's sequence; returns /update_weights' status and answer."""
        self.ok("/pause?mode=wait")
        self.ok("/start_weight_update")
        status, answer = self.call("/update_weights", {"update_info": {"version": version}})
        if status == 200:
            self.ok("/finish_weight_update", {"weight_version": str(version)})
        self.ok("/resume")
        return status, answer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 with large weights (greedy choices far from ties) saved in bf16, and the
    trainer's fp32 model it was saved from."""
    model, tok = decisive_qwen3()
    folder = tmp_path_factory.mktemp("model")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)  # vLLM starts from the trainer's v0 bits
    tok.save_pretrained(folder)
    return str(folder), model


@pytest.mark.timeout(1200)
def test_vllm_serve_follows_the_trainer_verified_and_refuses_a_forger(setup, tmp_path):
    folder, model = setup
    opt, gen = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator().manual_seed(1)
    pub = Publisher(model, tmp_path / "store")  # v0: the weights the folder holds, in bf16
    origin = pub.serve(TOKEN)
    states = [policy_state(model)]
    forger = None
    log = tmp_path / "vllm.log"
    (tmp_path / "prometheus").mkdir()
    try:
        with vllm_serve(
            folder,
            log,
            origin.url,
            *("--max-model-len", "256"),
            SPARROWRL_TOKEN=TOKEN,
            PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prometheus"),  # the backend's metrics in /metrics
        ) as base:
            server = Server(base, folder)
            # the weights vLLM loaded from the folder, read back out of its kernels, are the trainer's v0
            assert server.status()["state_hash"] == state_hash(states[0]) == pub.state_hash
            texts = [server.greedy()]
            for v in range(1, N + 1):
                step(model, opt, gen)
                assert pub.publish() == v
                states.append(policy_state(model))
                if v not in UPDATES:
                    continue
                t = time.monotonic()
                assert server.update(v)[0] == 200
                print(f"v{v}: pause to resume in {time.monotonic() - t:.2f} s")
                assert server.version() == str(v)
                s = server.status()
                assert (s["version"], s["state_hash"]) == (v, state_hash(states[v])) == (v, pub.state_hash)
                assert s["held_version"] == v and all(x > v for x in s["staged"]), s
                texts.append(server.greedy())
            assert texts[0] != texts[-1]  # the versions generate differently: the hash checks have teeth

            # the forger's v4, with the trainer's v3 under it, which it cannot sign (it lacks the key): refused
            forged = {n: t.clone() for n, t in states[N].items()}
            forged["model.embed_tokens.weight"][:, :8] = 1.0
            fake = Store.init(tmp_path / "forger", states[N], base_every=10, version=N)
            forge(fake, states[N], forged)
            forger = Origin(fake.path)  # loopback, admits anyone, signs nothing
            server.ok("/init_weight_transfer_engine", {"init_info": {"origin": [forger.url]}})
            status, answer = server.update(N + 1)
            assert status != 200 and "unsigned" in str(answer), answer
            assert server.version() == str(N)
            s = server.status()
            assert (s["version"], s["state_hash"]) == (N, state_hash(states[N]))
            assert s["updates"]["failed"] == 1 and s["refused"].get(forger.url, 0) >= 1, s
            assert server.greedy() == texts[-1]
            assert "refused" in log.read_text() and forger.url in log.read_text()

            # the trainer's own v4 from its origin: served again
            step(model, opt, gen)
            pub.publish()
            server.ok("/init_weight_transfer_engine", {"init_info": {"origin": [origin.url]}})
            assert server.update(N + 1)[0] == 200
            assert server.version() == str(N + 1)
            assert server.status()["state_hash"] == pub.state_hash
            with urllib.request.urlopen(server.base + "/metrics", timeout=60) as r:
                metrics = r.read().decode()
            assert f'sparrowrl_weight_updates_total{{result="ok"}} {len(UPDATES) + 1}.0' in metrics, metrics[-3000:]
            assert 'sparrowrl_weight_updates_total{result="failed"} 1.0' in metrics
            assert f'sparrowrl_refused_answers_total{{server="{forger.url}"}}' in metrics
            assert f"sparrowrl_served_version {N + 1}.0" in metrics
    finally:
        origin.close()
        if forger is not None:
            forger.close()

"""The standard vLLM server with SparrowRL's backend, for tests/engine_vllm: started with the
flags and environment its tests share, awaited with a deadline, and ended with its engine core
and worker (its own process group) however the test ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from sparrowrl.auth.signing import KEY_ENV, public_text, signing_key
from support.servers import TOKEN, free_port, get
from support.wait import until

START_S = 300  # vLLM's three processes start in about a minute on a 2-core VM


@contextlib.contextmanager
def vllm_serve(folder: str | Path, log: Path, origin: str, *flags: str, **env: str) -> Iterator[str]:
    """A server of `folder` in dev mode, following `origin` with the trainer's key of TOKEN;
    yields its base URL once it answers /health. `flags` and `env` add to the shared ones."""
    port = free_port()
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        SPARROWRL_ORIGIN=origin,
        **{KEY_ENV: public_text(signing_key(TOKEN))},
        **env,
    )
    # `vllm serve`'s own module: vllm-cpu's `vllm` command asks for the distribution "vllm" and fails
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(folder)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager"),
        *("--max-num-seqs", "8", "--seed", "0", "--generation-config", "vllm"),
        *("--weight-transfer-config", '{"backend": "sparrowrl"}'),
        *("--worker-extension-cls", "sparrowrl.integrations.vllm_plugin.SparrowRLWorkerExtension"),
        *flags,
    ]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:  # the log says why, if it ended first
        assert proc.poll() is None, log.read_text()[-5000:]
        return get(base + "/health") == 200

    try:
        until(healthy, START_S, "vllm serve answering /health", every=0.5)
        print(f"vllm serve up in {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the API server, engine core and worker
            try:
                os.killpg(proc.pid, sig)
                proc.wait(30)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        print(log.read_text()[-3000:])

"""The `vllm.general_plugins` entry point. vLLM calls `register()` once in each of its processes
(API server, engine core, workers) before it builds a worker, so this is where the backend
becomes selectable (`--weight-transfer-config '{"backend": "sparrowrl"}'`) and where the CPU
build's workarounds reach the worker process (every CPU vLLM server of an environment where
sparrowrl is installed gets them, whichever backend it uses: vLLM's engine core picks its
attention kernel before anything says which backend is in use, and the in-process rollout engine
relies on them there). Light: the backend module loads only when a worker creates the engine."""

from __future__ import annotations

from sparrowrl import logs
from sparrowrl.integrations.vllm_cpu import cpu_workarounds

NAME = "sparrowrl"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    logs.adopt()  # vLLM configures its own logger only: the backend's lines would go nowhere
    try:
        WeightTransferEngineFactory.register_engine(
            NAME, "sparrowrl.integrations.vllm_backend", "SparrowRLWeightTransferEngine"
        )
    except ValueError:  # taken already: vLLM loads plugins once per process, but may run them again
        pass
    if current_platform.is_cpu():  # in every CPU vLLM process of this environment (docs/vllm.md)
        cpu_workarounds()


class SparrowRLWorkerExtension:
    """`--worker-extension-cls sparrowrl.integrations.vllm_plugin.SparrowRLWorkerExtension`: vLLM
    mixes it into its worker class, which makes `sparrowrl_status` callable through
    `collective_rpc` (dev mode's `POST /collective_rpc {"method": "sparrowrl_status"}`): the
    served version, the hash of the weights read back, counters, refused servers."""

    def sparrowrl_status(self) -> dict:
        from sparrowrl.integrations import vllm_backend

        return vllm_backend.status()

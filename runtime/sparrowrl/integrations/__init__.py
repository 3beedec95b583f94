"""SparrowRL inside other frameworks' processes: a weight-transfer backend for `vllm serve`
(`vllm_plugin`, `vllm_backend`) and the mapping between the trainer's tensors and vLLM's
parameters that the in-process engine shares (`vllm_layout`). Nothing here imports vLLM at
module top: `vllm_plugin` is loaded by vLLM itself, in every one of its processes."""

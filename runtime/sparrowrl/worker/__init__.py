"""A rollout worker (`sparrowrl worker`) and its generation engines (Hugging Face, vLLM)."""

"""Adapters that let frameworks call ubep: `ubep.integrations.vllm` (vLLM's all2all backend)."""

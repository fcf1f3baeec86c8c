"""Benchmark clients: `stratamesh bench serve` measures an OpenAI-compatible server like `vllm bench serve`."""

"""Offline analysis of a pair, no vLLM: the teacher-forced acceptance estimate and ``vllm-usd analyze``."""

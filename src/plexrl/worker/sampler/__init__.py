"""Samplers: engines that generate completions with per-token logprobs."""

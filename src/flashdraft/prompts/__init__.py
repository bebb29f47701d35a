"""Prompts: files in the common formats, the benchmark sets, and code-writing prompts from the standard library."""

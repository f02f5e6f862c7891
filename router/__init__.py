"""kvgate router: the OpenAI-compatible KV-aware gateway, admin API, metrics and the CLI."""

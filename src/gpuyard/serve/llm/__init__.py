"""An OpenAI-compatible language-model server with continuous batching (docs/llm.md)."""

"""An OpenAI-compatible server for an engine the agent wrote (docs/serving.md).

tokenizer (text ↔ ids, chat templates)  detokenizer (ids → UTF-8-safe text, stop strings)
sampler (next tokens on the device)  scheduler (continuous batching, the engine's one thread)
model (what to serve, loading it)  service (requests → jobs → text)  protocol (OpenAI's wire
format)  api (the FastAPI app)  bench (the benchmark client)  __main__ (the CLI)
"""

"""The agent that writes, verifies and tunes an LLM inference engine."""

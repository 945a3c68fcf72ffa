"""What a model costs, per million tokens (USD), to keep a run's spending under its budget.

List prices as published by the providers (checked 2025; verify before relying on them).
A model matches the longest entry that starts its name, so dated snapshots
(`claude-sonnet-4-5-20250929`, `gpt-4.1-2025-04-14`) find their family. A model not in
the table (a local server's, a new release) is charged at `UNKNOWN_PRICE`, deliberately
high so an unknown model cannot overspend, unless `LLM_PRICE_PER_MTOK="in,out"` says
otherwise (e.g. `0,0` for a local server).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

PRICE_ENV = "LLM_PRICE_PER_MTOK"


@dataclass(frozen=True)
class Price:
    input_per_mtok: float
    output_per_mtok: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


PRICES: dict[str, Price] = {
    # OpenAI
    "gpt-5": Price(1.25, 10.00),
    "gpt-5-mini": Price(0.25, 2.00),
    "gpt-5-nano": Price(0.05, 0.40),
    "gpt-4.1": Price(2.00, 8.00),
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "o3": Price(2.00, 8.00),
    "o3-mini": Price(1.10, 4.40),
    "o4-mini": Price(1.10, 4.40),
    # Anthropic
    "claude-opus-4-5": Price(5.00, 25.00),
    "claude-opus-4": Price(15.00, 75.00),
    "claude-sonnet-4": Price(3.00, 15.00),
    "claude-3-7-sonnet": Price(3.00, 15.00),
    "claude-haiku-4-5": Price(1.00, 5.00),
    "claude-3-5-haiku": Price(0.80, 4.00),
}
UNKNOWN_PRICE = Price(15.00, 75.00)


def price_for(model: str) -> tuple[Price, str]:
    """The price of `model` and where it came from ("table: gpt-5", "env", "unknown")."""
    override = os.environ.get(PRICE_ENV)
    if override:
        try:
            inp, out = (float(x) for x in override.split(","))
        except ValueError as e:
            raise ValueError(f"{PRICE_ENV} must be 'input,output' USD per million tokens, got {override!r}") from e
        return Price(inp, out), f"env {PRICE_ENV}"
    name = model.lower().split("/")[-1]  # "openai/gpt-5" on routers
    matches = [k for k in PRICES if name == k or name.startswith(k + "-")]
    if not matches:
        return UNKNOWN_PRICE, "unknown model, charged at the table's highest price"
    key = max(matches, key=len)
    return PRICES[key], f"table: {key}"

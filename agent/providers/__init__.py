"""Proposers, chosen by `--provider`. LLM providers are imported only when asked for.

A provider `NAME` is a module `agent/providers/NAME.py` with

    def create(options: ProviderOptions) -> Proposer

It may raise (no API key, package missing); the run then goes on with the builtin proposer
and says so. `options.builtin` is the offline proposer, for a provider that wants to take
turns with it or fall back on it.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.providers.builtin import BuiltinProposer
from agent.records import Proposer

NAMES = ("builtin", "openai", "anthropic", "replay", "auto")
# "auto" picks the first provider whose key is in the environment, else builtin.
AUTO_ORDER = (("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY"), ("openai", "OPENAI_BASE_URL"))


@dataclass
class ProviderOptions:
    device: str
    seed: int
    workspace: Path                  # where a provider may keep transcripts
    builtin: "BuiltinProposer"
    log: Callable[[str], None] | None = None   # one line to results.log and the console
    model: str | None = None                    # `--model`: the LLM to ask (None: the provider's default)


def resolve_name(name: str) -> str:
    if name != "auto":
        return name
    return next((provider for provider, var in AUTO_ORDER if os.environ.get(var)), "builtin")


def make_proposer(name: str, options: ProviderOptions, warn: Callable[[str], None]) -> Proposer:
    """The proposer for `--provider NAME`; the builtin one if that provider cannot start."""
    name = resolve_name(name)
    if name == "builtin":
        return options.builtin
    try:
        module = importlib.import_module(f"agent.providers.{name}")
        return module.create(options)
    except Exception as e:  # noqa: BLE001 - any failure to start a provider means: go on offline
        warn(f"provider '{name}' unavailable ({type(e).__name__}: {e}); using the builtin proposer")
        return options.builtin

"""Next tokens from a step's logits, on the logits' device, for a batch of mixed settings.

Greedy rows take the argmax of the raw logits, so greedy output is exactly what driving the
engine directly gives. Sampled rows are scaled by their temperature, cut to their top-k and
top-p, and drawn by the exponential race (argmax of p / E with E ~ Exp(1), which picks index i
with probability p_i): the noise comes from the request's own torch.Generator when it gave a
seed (its output then depends on nothing else in the batch), from the server's otherwise. The
whole step stays on the device; the caller's one `.tolist()` is the only host sync. A request's
logit_bias is added to its row, and its presence and frequency penalties taken off it (OpenAI's
rule, over the tokens it generated so far: `frequency * count + presence * (count > 0)`), before
either pick, in a copy made only in a step where some request has one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5   # at or below this, a temperature means greedy (OpenAI's 0)
MIN_NOISE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (already validated by the API layer)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0: no top-k cut
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    presence_penalty: float = 0.0    # taken off the logit of every token generated so far
    frequency_penalty: float = 0.0   # ... times the times it was generated

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator (None without a seed: it shares the server's)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature with each row cut to its top-k and top-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    scaled = logits.float() / temperature.unsqueeze(1)
    vocab = scaled.shape[1]
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        ordered, order = scaled.sort(dim=1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        cut = rank >= top_k.unsqueeze(1)
        probs = ordered.masked_fill(cut, float("-inf")).softmax(dim=1)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        mass_before = probs.cumsum(dim=1) - probs    # probability of the better-ranked tokens
        cut |= (mass_before >= top_p.unsqueeze(1)) & (rank > 0)   # the best token always stays
        ordered = ordered.masked_fill(cut, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)
    return scaled.softmax(dim=1)


def _biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` (not changed: a copy) with each row's logit_bias added."""
    rows, tokens, biases = zip(*[(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias])
    device = logits.device
    return logits.index_put((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                            torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)


def _penalized(logits: torch.Tensor, params: list[SamplingParams], generated: list[list[int]]) -> torch.Tensor:
    """`logits` (not changed: a copy) with each penalized row's penalties taken off the tokens
    its request generated so far."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, (p, tokens) in enumerate(zip(params, generated)):
        if p.penalized and tokens:
            counts = torch.bincount(torch.tensor(tokens, device=logits.device), minlength=vocab)[:vocab]
            out[i] -= (p.frequency_penalty * counts + p.presence_penalty * (counts > 0)).to(out.dtype)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           generated: list[list[int]] | None = None) -> torch.Tensor:
    """The next token of each row of `logits` [B, vocab], as a LongTensor [B] on its device;
    `generated`: each row's request's tokens so far (what its penalties count)."""
    if any(p.logit_bias for p in params):
        logits = _biased(logits, params)
    if generated is not None and any(p.penalized for p in params):
        logits = _penalized(logits, params, generated)
    greedy = logits.argmax(dim=1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs = _filtered_probs(logits.index_select(0, rows), [params[i] for i in sampled_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(sampled_rows):
        noise[j].exponential_(generator=generators[i])
    noise.clamp_(min=MIN_NOISE)   # an exact 0 would make p / E infinite (or NaN where p is 0)
    return greedy.index_copy(0, rows, (probs / noise).argmax(dim=1))

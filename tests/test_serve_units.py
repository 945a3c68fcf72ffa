"""The server's pieces alone: tokenizers and chat templates (a tiny BPE trained here, no
downloads), the incremental detokenizer, the device sampler, what to serve (model.py)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from serve.detokenizer import Detokenizer
from serve.model import ModelError, resolve_source
from serve.sampler import SamplingParams, make_generator, sample
from serve.scheduler import out_of_memory
from serve.tokenizer import ByteTokenizer, ChatTemplateError, HFTokenizer, TokenizerFileError, load_tokenizer

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
TEXTS = ["héllo wörld, the quick brown fox 😀 jumps", "über naïve café — 日本語のテキスト", "plain ascii text here"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A byte-level BPE trained on a few lines, with a chat template that has a thinking switch."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": THINKING_TEMPLATE}))
    return folder


def stream_text(tokenizer, prompt_ids, ids, stops=()):
    detok = Detokenizer(tokenizer, prompt_ids, list(stops))
    parts = [detok.push(i) for i in ids]
    parts.append(detok.finish())
    return parts, detok


def test_byte_tokenizer_round_trip_and_high_ids():
    tok = ByteTokenizer()
    text = "héllo 😀"
    assert tok.decode(tok.encode(text, True)) == text
    assert tok.decode([104, 300, 4095, 105]) == "hi"   # ids >= 256 decode to nothing


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_streamed_increments_are_valid_utf8(kind, hf_folder, test_seed):
    """Every increment is whole characters (no U+FFFD from a split character), and together
    they are the text of all ids, whatever splits the tokens make."""
    tok = ByteTokenizer() if kind == "byte" else HFTokenizer(hf_folder)
    rng = random.Random(test_seed)
    text = "".join(rng.choice(TEXTS[0] + TEXTS[1]) for _ in range(60))
    ids = tok.encode(text, False)
    parts, _ = stream_text(tok, tok.encode("prompt: ", False), ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    if kind == "byte":
        assert sum(1 for p in parts if p) < len(ids)   # multi-byte characters were held back


def test_stop_string_across_tokens_is_held_back():
    tok = ByteTokenizer()
    ids = tok.encode("abcSTOPdef", False)
    parts, detok = stream_text(tok, [], ids, stops=["STOP", "zz"])
    assert "".join(parts) == "abc" and detok.stopped
    assert all("S" not in p for p in parts)      # the stop's start never went out
    parts, detok = stream_text(tok, [], tok.encode("abcSTdef", False), stops=["STOP"])
    assert "".join(parts) == "abcSTdef" and not detok.stopped


def test_invalid_bytes_end_as_replacement():
    parts, _ = stream_text(ByteTokenizer(), [], [0x41, 0xE2, 0x82])   # "A" and half of "€"
    assert "".join(parts) == "A\ufffd"


def test_hf_tokenizer_chat_template_and_thinking_switch(hf_folder):
    tok = load_tokenizer([hf_folder.parent / "nowhere", hf_folder])
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_ids == {tok._tok.token_to_id("</s>")}
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages, {}) == "<s><|user|>hi<|end|><|assistant|>"
    assert tok.render_chat(messages, {"enable_thinking": False}).endswith("<|assistant|><think></think>")
    assert tok.decode(tok.encode(TEXTS[1], False)) == TEXTS[1]


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'x'}) }}",                  # mutating what it is given
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",       # reaching Python internals
    "{{ raise_exception('no system messages') }}",
])
def test_chat_template_is_sandboxed(hf_folder, tmp_path, template):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ChatTemplateError):
        HFTokenizer(tmp_path).render_chat([{"role": "user", "content": "hi"}], {})


@pytest.mark.parametrize("name, text", [
    ("tokenizer.json", "not json"),
    ("tokenizer_config.json", "not json"),
    ("tokenizer_config.json", json.dumps({"chat_template": "{% if %}"})),   # does not compile
    ("generation_config.json", "{"),
])
def test_unreadable_tokenizer_file_is_named(hf_folder, tmp_path, name, text):
    """The server's start-up line names the broken file, not only the parser's complaint."""
    for good in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / good).write_bytes((hf_folder / good).read_bytes())
    (tmp_path / name).write_text(text)
    with pytest.raises(TokenizerFileError, match=str(tmp_path / name)):
        load_tokenizer([tmp_path])


def test_sampler_greedy_top_k_and_seeds(test_seed):
    gen = torch.Generator().manual_seed(test_seed)
    logits = torch.randn(6, 50, generator=gen) * 3
    params = [SamplingParams(0.0), SamplingParams(1.0, top_k=1), SamplingParams(0.7, top_k=3, seed=5),
              SamplingParams(1.0, top_p=1e-6, seed=6), SamplingParams(1.3, seed=7), SamplingParams(1.0)]
    out = sample(logits, params, [make_generator(p.seed, "cpu") for p in params])
    best = logits.argmax(dim=1)
    assert out[0] == best[0] and out[1] == best[1] and out[3] == best[3]   # greedy, top_k=1, tiny top_p
    assert out[2] in logits[2].topk(3).indices
    # a seeded row is reproducible and independent of its neighbours
    again = sample(logits[[4, 2]], [params[4], params[2]], [make_generator(7, "cpu"), make_generator(5, "cpu")])
    assert again.tolist() == [out[4], out[2]]


def test_sampler_follows_the_distribution(test_seed):
    """Frequencies of 4000 draws within 0.03 of softmax(logits / T), cut to top-p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draws = 4000
    params = [SamplingParams(0.8, top_p=0.9)] * draws
    gens = [make_generator(test_seed + i, "cpu") for i in range(draws)]
    out = sample(logits.expand(draws, -1), params, gens)
    probs = (logits[0] / 0.8).softmax(0)
    keep = (probs.cumsum(0) - probs) < 0.9
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    freq = torch.bincount(out, minlength=5).float() / draws
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_source_from_the_runs_record(tmp_path, tiny_model):
    """Without --weights: the model results.json recorded for the engine's run."""
    engine = tmp_path / "engine.py"
    engine.write_text("")
    with pytest.raises(ModelError, match="results.json"):
        resolve_source(engine, None, None)
    (tmp_path / "results.json").write_text(json.dumps(
        {"run": {"config": str(tiny_model.config_path), "weights": str(tiny_model.weight_dir)}}))
    source = resolve_source(engine, None, None)
    assert (source.config, source.weights) == (tiny_model.config_path.resolve(), tiny_model.weight_dir.resolve())
    # --weights alone: the course layout's model_config.json beside weights/; a HF folder's config.json first
    assert resolve_source(engine, tiny_model.weight_dir, None).config == tiny_model.config_path.resolve()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_source(engine, hf, None).config == hf / "config.json"
    with pytest.raises(ModelError, match="no engine"):
        resolve_source(tmp_path / "missing.py", None, None)


def test_a_missing_engine_points_at_the_last_runs_when_a_new_run_moved_it_aside(tmp_path):
    with pytest.raises(ModelError, match="run `bash run.sh` first, or pass --engine$"):
        resolve_source(tmp_path / "engine.py", None, None)
    (tmp_path / "previous").mkdir()
    (tmp_path / "previous" / "engine.py").write_text("# the last run's engine\n")
    with pytest.raises(ModelError, match=r"\(the last run's: --engine .*previous/engine\.py\)"):
        resolve_source(tmp_path / "engine.py", None, None)


def test_a_workspace_for_engine_or_a_file_for_weights_is_named_as_such(tmp_path):
    """Not "no engine" for the workspace folder, nor "does not exist" for a weights path that is a file."""
    (tmp_path / "engine.py").write_text("")
    with pytest.raises(ModelError, match=r"is a folder; its engine is --engine .*engine\.py"):
        resolve_source(tmp_path, None, None)
    with pytest.raises(ModelError, match="is a file"):
        resolve_source(tmp_path / "engine.py", tmp_path / "engine.py", None)


def test_sampler_logit_bias(test_seed):
    """A bias is added to its own row only, before greedy and sampled picks alike; the caller's
    logits are left as they were."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(test_seed))
    before = logits.clone()
    best = int(logits[2].argmax())
    params = [SamplingParams(0.0, logit_bias=((7, 100.0),)), SamplingParams(0.0),
              SamplingParams(1.0, seed=3, logit_bias=((best, -100.0), ((best + 1) % 20, 100.0)))]
    out = sample(logits, params, [make_generator(p.seed, "cpu") for p in params]).tolist()
    assert out == [7, int(logits[1].argmax()), (best + 1) % 20]
    assert torch.equal(logits, before)


def test_out_of_memory_is_told_from_other_engine_errors():
    """What the scheduler queues again (an engine out of memory) and what fails the request: the
    tensor-parallel engine's wrapped error is a failure, as that engine stops for good after one."""
    try:
        torch.empty(2**55, dtype=torch.uint8)   # the CPU allocator's error is an untyped RuntimeError
    except RuntimeError as e:
        cpu = e
    assert out_of_memory(cpu) and out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) and out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("tensor-parallel engine failed during decode: OutOfMemoryError: CUDA out of memory"))
    assert not out_of_memory(ValueError("expected logits [1, 256], got (1, 5)"))


def test_sampler_presence_and_frequency_penalties(test_seed):
    """OpenAI's rule over the tokens a request generated: `frequency * count + presence *
    (count > 0)` off each one's logit, its own row only, the caller's logits left as they were."""
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(test_seed))
    order = logits.argsort(dim=1, descending=True)
    for row in range(4):   # the best token 1.0 above the second
        logits[row, order[row, 0]] = logits[row, order[row, 1]] + 1.0
    before = logits.clone()
    best, second = order[:, 0].tolist(), order[:, 1].tolist()
    params = [SamplingParams(0.0, frequency_penalty=0.4), SamplingParams(0.0, presence_penalty=1.5),
              SamplingParams(0.0, presence_penalty=0.5), SamplingParams(0.0)]
    generated = [[best[0]] * 3, [second[1]], [best[2]] * 5, [best[3]] * 5]
    out = sample(logits, params, [None] * 4, generated).tolist()
    # 3 x 0.4 off the best: the second; 1.5 off the second only: the best; 0.5 off the best once
    # however often it came (not 2.5): still the best; no penalty: the best
    assert out == [second[0], best[1], best[2], best[3]]
    assert torch.equal(logits, before)
    assert sample(logits, params, [None] * 4).tolist() == best   # no history given: nothing taken off


def test_bench_refuses_an_out_folder_it_cannot_write_before_running(tmp_path, capsys):
    """`--out /nope/x.json` ran the whole benchmark, then lost it to a FileNotFoundError traceback."""
    from serve.bench import main
    with pytest.raises(SystemExit) as e:
        main(["--url", "http://127.0.0.1:9", "--out", str(tmp_path / "none" / "x.json")])
    assert e.value.code == 2 and "does not exist or cannot be written" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, words", [
    ("--concurrency", "a,b", "'a' is not a whole number"), ("--concurrency", ",", "no concurrency level"),
    ("--concurrency", "1,0", "0 is less than 1"), ("--input-len", "0", "0 is less than 1"),
    ("--output-len", "-5", "-5 is less than 1"), ("--warmup", "-1", "-1 is less than 0"),
    ("--requests", "x", "'x' is not a whole number"),
])
def test_bench_refuses_bad_counts_naming_the_flag(capsys, flag, value, words):
    """Lengths of 0 or less had gone to the server; "a,b" had read "invalid <lambda> value"."""
    from serve.bench import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--url", "http://127.0.0.1:9", f"{flag}={value}"])
    assert e.value.code == 2 and f"argument {flag}: {words}" in capsys.readouterr().err


def test_bench_names_the_server_it_cannot_reach(tmp_path, capsys):
    from serve.bench import main
    assert main(["--url", "http://127.0.0.1:9", "--concurrency", "1", "--requests", "1", "--warmup", "0",
                 "--classes", "short", "--out", str(tmp_path / "b.json")]) == 1
    assert "error: cannot reach http://127.0.0.1:9" in capsys.readouterr().err

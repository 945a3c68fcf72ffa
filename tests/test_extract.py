"""Code-block extraction from model answers in the shapes models actually send."""
import pytest

from agent.extract import ExtractError, blocks, extract_code, extract_json

FN = ("silu_mul__llm_1",)
CODE = "def silu_mul__llm_1(gate_up):\n    return gate_up\n"


def test_fenced_with_language_tag():
    assert extract_code(f"Here:\n```python\n{CODE}```\nDone.", FN) == CODE


def test_fenced_without_language_tag():
    assert extract_code(f"```\n{CODE}```", FN) == CODE


def test_tilde_fence_and_crlf():
    text = f"~~~py\r\n{CODE.replace(chr(10), chr(13) + chr(10))}~~~\r\n"
    assert extract_code(text, FN) == CODE


def test_several_blocks_pick_the_one_with_the_slot_function():
    text = ("First a helper:\n```python\ndef helper(x):\n    return x\n```\n"
            f"The answer:\n```python\nimport torch\n{CODE}```\n"
            "Usage:\n```python\ny = silu_mul__llm_1(x)\n```\n")
    assert "def silu_mul__llm_1" in extract_code(text, FN)
    assert "import torch" in extract_code(text, FN)


def test_block_with_all_functions_beats_a_longer_partial_one():
    fns = ("rmsnorm__llm_2", "add_rmsnorm__llm_2")
    partial = "def rmsnorm__llm_2(x, w, eps):\n" + "    x = x\n" * 40 + "    return x\n"
    full = "def rmsnorm__llm_2(x, w, eps):\n    return x\n\ndef add_rmsnorm__llm_2(x, r, w, eps):\n    return x, r\n"
    text = f"```python\n{partial}```\n```python\n{full}```"
    assert extract_code(text, fns) == full


def test_unterminated_fence_takes_the_rest():
    assert extract_code(f"```python\n{CODE}", FN) == CODE


def test_indented_fence_is_dedented():
    text = "1. Code:\n   ```python\n   def silu_mul__llm_1(g):\n       return g\n   ```\n"
    assert extract_code(text, FN) == "def silu_mul__llm_1(g):\n    return g\n"


def test_no_fence_whole_text_if_it_parses():
    assert extract_code(CODE, FN) == CODE


def test_no_fence_prose_is_an_error():
    with pytest.raises(ExtractError, match="no ```python code block"):
        extract_code("I would use a Triton kernel with a block size of 1024.", FN)


def test_empty_answer_is_an_error():
    with pytest.raises(ExtractError, match="empty"):
        extract_code("   \n", FN)


def test_non_python_blocks_are_ignored():
    with pytest.raises(ExtractError):
        extract_code("```bash\npip install triton\n```\n", FN)


def test_blocks_reports_closed():
    (b,) = blocks("```python\nx = 1\n")
    assert not b.closed and b.info == "python"


def test_extract_json():
    text = 'Change the plan:\n```json\n{"plan": {"engine": "paged", "params": {"block_size": 32}}}\n```'
    assert extract_json(text)["plan"]["params"] == {"block_size": 32}
    assert extract_json('{"plan": {}}') == {"plan": {}}
    with pytest.raises(ExtractError, match="JSON"):
        extract_json("```json\n{not json\n```")


def test_a_long_run_of_blank_lines_is_read_in_linear_time():
    """300000 blank lines before the code: the function search once crossed newlines from every
    line start (quadratic) and froze the whole agent for minutes (red-team helper, twenty-ninth
    session); now milliseconds, bounded here far below what the quadratic form took."""
    import time
    start = time.monotonic()
    assert extract_code("```python\n" + "\n" * 300_000 + CODE + "```", FN).endswith(CODE)
    assert time.monotonic() - start < 5.0

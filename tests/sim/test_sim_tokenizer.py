"""Tokenization matches vLLM's for the tiny fixture model; the built-in one is deterministic."""

from __future__ import annotations

import pytest
from simfix import captured_requests
from support.paths import TINY_MODEL

from smart_epp.benchmarks.sim.tokenizer import BuiltinTokenizer, HFTokenizer, load_tokenizer


@pytest.mark.parametrize("scenario", ["basic", "eviction", "lora", "restart", "cbor"])
def test_hf_tokenizer_reproduces_vllm_prompt_ids(scenario):
    tok = HFTokenizer(TINY_MODEL)
    for req in captured_requests(scenario):
        if "messages" in req.body:
            ids = tok.encode_chat(req.body["messages"])
        else:
            ids = tok.encode_prompt(req.body["prompt"])
        assert ids == req.prompt_token_ids, req.name


def test_hf_chat_has_no_bos_and_ends_with_the_generation_prompt():
    tok = HFTokenizer(TINY_MODEL)
    text = tok.render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] != 0
    assert tok.encode_prompt("hi")[0] == 0
    assert "request" in tok.decode(tok.encode_prompt("request"))


def test_builtin_tokenizer_is_deterministic_and_prefix_stable():
    tok = load_tokenizer(None, vocab_size=1000)
    assert isinstance(tok, BuiltinTokenizer)
    a = tok.encode_prompt("the quick brown fox jumps")
    assert a == tok.encode_prompt("the quick brown fox jumps")
    assert a[0] == BuiltinTokenizer.BOS and len(a) == 6
    assert tok.encode_prompt("the quick brown cat")[:4] == a[:4]
    assert all(16 <= t < 1000 for t in a[1:])
    chat = tok.encode_chat([{"role": "system", "content": "x y"}, {"role": "user", "content": "z"}])
    assert len(chat) == 2 + 2 + 1 + 2 + 1
    assert isinstance(tok.decode(a), str)


def test_bad_inputs_raise():
    with pytest.raises(FileNotFoundError):
        HFTokenizer("/nonexistent")
    with pytest.raises(ValueError):
        BuiltinTokenizer(4)
    with pytest.raises(ValueError):
        BuiltinTokenizer().encode_chat([{"role": "user", "content": [{"type": "image_url"}]}])

"""Tokenizers: the character tokenizer of model T and tokenizer.json files via `tokenizers`."""

import json
import os
import string

import pytest
from tokenizers import Tokenizer as HFLib
from tokenizers import decoders, models, pre_tokenizers, trainers

from rpeg_jax.config import ConfigError, DataConfig
from rpeg_jax.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, completion_ids, load_tokenizer

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "tokenizer")


def test_char_tokenizer_ids_by_hand():
    tok = CharTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (128, 0, 1, 2)
    # ASCII code points, written out: '1'=49 '2'=50 '+'=43 '='=61 ' '=32 'a'=97 '~'=126
    assert tok.encode("12+ a=~") == [49, 50, 43, 32, 97, 61, 126]
    assert tok.encode("") == []
    assert isinstance(tok, Tokenizer)


def test_char_tokenizer_round_trip_all_printable():
    tok = CharTokenizer()
    text = string.printable  # printable ASCII + whitespace; \r \x0b \x0c are not in the vocab
    text = "".join(c for c in text if c not in "\r\x0b\x0c")
    ids = tok.encode(text)
    assert all(2 < i < 128 for i in ids)
    assert tok.decode(ids) == text


def test_char_tokenizer_specials_and_junk():
    tok = CharTokenizer()
    # bos, '4', pad, '2', eos are decoded as "42"; ids with no character (5, 127) as U+FFFD
    assert tok.decode([1, 52, 0, 50, 2]) == "42"
    assert tok.decode([52, 5, 127]) == "4\ufffd\ufffd"
    with pytest.raises(ValueError, match=r"'é'.*position 2"):
        tok.encode("ab\u00e9")


def test_completion_ids_cut_at_first_eos_or_stop():
    assert completion_ids([51, 50, 2, 49, 0, 0], eos_id=2) == [51, 50]
    assert completion_ids([51, 50, 49], eos_id=2) == [51, 50, 49]
    assert completion_ids([51, 10, 50, 2], eos_id=2, stop_ids=[10]) == [51]


def _word_level(path, with_config=None):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5, "!": 6}
    tok = HFLib(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    if with_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(with_config))
    return str(path / "tokenizer.json")


def test_hf_word_level_ids_by_hand(tmp_path):
    tok = HFTokenizer(_word_level(tmp_path))
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (7, 0, 1, 2)
    assert tok.encode("hello world!") == [4, 5, 6]  # whitespace/punctuation split, vocab above
    assert tok.encode("hello moon") == [4, 3]  # unknown word -> [UNK]
    assert tok.decode([1, 4, 5, 2, 0]) == "hello world"  # specials dropped
    assert isinstance(tok, Tokenizer)


def test_hf_special_tokens_from_config_and_explicit(tmp_path):
    path = _word_level(tmp_path, {"bos_token": {"content": "hello"}, "eos_token": "world", "pad_token": None})
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (4, 5, 0)  # config names win; pad found by name
    tok = HFTokenizer(path, eos_token="!", bos_token="</s>")
    assert (tok.bos_id, tok.eos_id) == (2, 6)
    with pytest.raises(ConfigError, match=r"data.eos_token='nope'"):
        HFTokenizer(path, eos_token="nope")


def test_hf_missing_or_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer.*file not found"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "none.json")))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="data.tokenizer.*cannot load"):
        load_tokenizer(DataConfig(tokenizer=str(bad)))


def test_hf_byte_level_bpe_round_trip(tmp_path):
    tok = HFLib(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["Natalia sold clips to 48 of her friends.", "#### 72", "\\boxed{\\frac{1}{2}}"] * 20, trainer
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")))
    assert ours.bos_id is None and ours.eos_id == ours.pad_id == tok.token_to_id("<|endoftext|>")
    for text in ["Natalia sold 48 clips.", "#### 72", "héllo wörld \\boxed{3}", ""]:
        ids = ours.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids + [ours.eos_id]) == text


def test_hf_fixture_matches_expected_ids():
    """The shared Hugging Face fixture (tests/fixtures/tokenizer): ids, special ids and decoded text
    recorded in expected.json by the fixture's generator."""
    expected = json.load(open(os.path.join(FIXTURE_DIR, "expected.json")))
    tok = HFTokenizer(os.path.join(FIXTURE_DIR, "tokenizer.json"))
    specials = expected["special_tokens"]
    assert tok.vocab_size == expected["vocab_size"]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (specials["<pad>"], specials["<s>"], specials["</s>"])
    assert len(expected["cases"]) >= 2
    for case in expected["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert [tok.bos_id] + tok.encode(case["text"]) + [tok.eos_id] == case["ids_with_special_tokens"]
        assert tok.decode(case["ids_with_special_tokens"]) == case["decoded"]

"""Tokenizers: char-level round trips, special ids, HF tokenizer.json through one interface."""

import pytest

from rlax_ps.tokenizers import CharTokenizer, HFTokenizer, make_tokenizer


def test_char_tokenizer_round_trips_text():
  tok = CharTokenizer()
  text = "123+45=168 rev abc=cba"
  ids = tok.encode(text, add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert len(ids) == len(text) + 2
  assert tok.decode(ids) == text
  assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
  assert max(ids) < tok.vocab_size


def test_char_tokenizer_special_ids_are_distinct_and_not_characters():
  tok = CharTokenizer("ab")
  assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
  assert tok.vocab_size == 5
  assert set(tok.encode("ab")).isdisjoint({tok.pad_id, tok.bos_id, tok.eos_id})


def test_char_tokenizer_rejects_unknown_characters():
  with pytest.raises(ValueError, match="'z' at position 1"):
    CharTokenizer("ab").encode("az")
  with pytest.raises(ValueError, match="duplicates"):
    CharTokenizer("aba")
  with pytest.raises(ValueError, match="outside"):
    CharTokenizer("ab").decode([9])


def test_saved_char_tokenizer_loads_as_hf_tokenizer_with_same_ids(tmp_path):
  char = CharTokenizer()
  char.save(str(tmp_path))
  hf = HFTokenizer(str(tmp_path))
  text = "rev hello world=dlrow olleh 9+9=18"
  assert hf.encode(text, add_bos=True, add_eos=True) == char.encode(text, add_bos=True,
                                                                       add_eos=True)
  assert (hf.bos_id, hf.eos_id, hf.pad_id) == (char.bos_id, char.eos_id, char.pad_id)
  assert hf.vocab_size == char.vocab_size
  assert hf.decode(char.encode(text, add_eos=True)) == text


def test_hf_tokenizer_specials_from_arguments_and_errors(tmp_path):
  CharTokenizer("abc").save(str(tmp_path))
  (tmp_path / "tokenizer_config.json").unlink()
  hf = HFTokenizer(str(tmp_path / "tokenizer.json"), eos_token="<bos>")
  assert hf.eos_id == 1
  assert hf.pad_id == 0  # "<pad>" is found by its common spelling.
  with pytest.raises(ValueError, match="eos_token: '<end>'"):
    HFTokenizer(str(tmp_path), eos_token="<end>")
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer(str(tmp_path / "missing"))


def test_make_tokenizer_checks_kind(tmp_path):
  assert make_tokenizer("char", alphabet="xy").vocab_size == 5
  with pytest.raises(ValueError, match="tokenizer.kind: expected 'char' or 'hf', got 'bpe'"):
    make_tokenizer("bpe")
  with pytest.raises(ValueError, match="tokenizer.path"):
    make_tokenizer("hf")

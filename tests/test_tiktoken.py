"""Kimi K2's and Moonlight's tokenizers: a tiktoken.model with tokenizer_config.json read as
a Hugging Face tokenizer, equal to tiktoken's own encodings (tests/fixtures/hf/kimi_tokenizer,
made by tests/fixtures/make_tiktoken_fixture.py), saved as a tokenizer.json, and refused
with the field named where it cannot be read."""

import json
import os
import shutil

import pytest

from rlax_ps.tiktoken_bpe import read_ranks, tiktoken_tokenizer
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer, tokenizer_from_config

KIMI = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "kimi_tokenizer")
EXPECTED = json.load(open(os.path.join(KIMI, "expected.json"), encoding="utf-8"))
BASE = EXPECTED["base"]


def test_a_tiktoken_file_encodes_as_tiktoken_does():
  """Every text (words, contractions, digits, Han runs, whitespace runs, emoji, special
  tokens inline, random mixes) to tiktoken's ids, and back."""
  tok = HFTokenizer(KIMI)
  assert tok.path.endswith("tiktoken.model")
  for text, ids in zip(EXPECTED["texts"], EXPECTED["ids"]):
    assert tok.encode(text) == ids, text
    assert tok.decode(ids, skip_special=False) == text
  # Its special tokens at their ids: named ones from tokenizer_config.json, the rest reserved.
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BASE, BASE + 1, BASE + 255)
  assert tok.vocab_size == BASE + 256
  assert tok.encode(f"<|reserved_token_{BASE + 5}|>") == [BASE + 5]
  assert tok.decode([BASE + 2, 5], skip_special=True) == tok.decode([5])


def test_its_chat_template_and_the_config_path_read_it():
  """As a run's tokenizer (tokenizer.kind=hf, the checkpoint's): a prompt under its chat
  template is tiktoken's ids of the rendered turn, special tokens included."""
  tok = tokenizer_from_config({"kind": "hf", "chat_template": "auto"}, KIMI)
  assert tok.encode_prompt([{"role": "user", "content": EXPECTED["question"]}]) == \
      EXPECTED["chat_ids"]
  with pytest.raises(ValueError, match="tokenizer.kind: 'char' .*its tiktoken.model"):
    CharTokenizer().check_checkpoint(KIMI)


def test_it_is_saved_as_a_tokenizer_json_beside_its_files(tmp_path):
  """An export carries the tiktoken files (for the class's own code) and the tokenizer.json
  made of them, which reads alike without them."""
  HFTokenizer(KIMI).save(str(tmp_path / "export"))
  names = set(os.listdir(tmp_path / "export"))
  assert {"tiktoken.model", "tokenizer_config.json", "tokenizer.json"} <= names
  os.remove(tmp_path / "export" / "tiktoken.model")
  saved = HFTokenizer(str(tmp_path / "export"))
  assert saved.path.endswith("tokenizer.json")
  for text, ids in zip(EXPECTED["texts"], EXPECTED["ids"]):
    assert saved.encode(text) == ids, text


def _copy(tmp_path):
  folder = tmp_path / "kimi"
  shutil.copytree(KIMI, folder)
  config = json.load(open(folder / "tokenizer_config.json"))
  return folder, config


def test_a_tiktoken_file_it_cannot_read_is_refused_naming_why(tmp_path):
  folder, config = _copy(tmp_path)
  config["auto_map"] = {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}
  json.dump(config, open(folder / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match="auto_map.AutoTokenizer: .* 'tokenization_qwen."
                     "QWenTokenizer', code rlax-ps does not run"):
    tiktoken_tokenizer(str(folder))
  folder, config = _copy(tmp_path / "low")
  config["added_tokens_decoder"]["3"] = {"content": "<x>", "special": True}
  json.dump(config, open(folder / "tokenizer_config.json", "w"))
  with pytest.raises(ValueError, match="added_tokens_decoder: id 3 is a BPE rank"):
    tiktoken_tokenizer(str(folder))
  folder, _ = _copy(tmp_path / "cut")
  lines = open(folder / "tiktoken.model", "rb").read().splitlines()
  open(folder / "tiktoken.model", "wb").write(b"\n".join(lines[:9] + [b"!!! 9"] + lines[10:]))
  with pytest.raises(ValueError, match=r"tiktoken.model:10: expected a base64 token"):
    read_ranks(str(folder / "tiktoken.model"))
  open(folder / "tiktoken.model", "wb").write(b"\n".join(lines[:9] + lines[10:]))
  with pytest.raises(ValueError, match=r"tiktoken.model: expected ranks 0..698, each once"):
    read_ranks(str(folder / "tiktoken.model"))
  os.remove(folder / "tokenizer_config.json")
  with pytest.raises(FileNotFoundError, match="needs its tokenizer_config.json"):
    tiktoken_tokenizer(str(folder))

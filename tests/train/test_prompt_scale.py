"""A large prompt file: the trainer holds its records compactly (random access, the feed's
order and checkpointed state as with dicts), each prompt is tokenized once across `rlax-ps
local`'s check and its trainer's, and the char tokenizer encodes a text at once."""

import json
import os
import re
import sys
import tracemalloc
from types import SimpleNamespace

import pytest

from rl_testlib import rl_config
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from rlax_ps.train import prompts
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.rl_checks import check_rl_config

RECORDS = [
    {"prompt": "12+34=", "answer": "46", "task": "addition"},
    {"prompt": "h\u00e9 \U0001F600 \"q\"\n\\", "answer": "", "task": "math"},
    {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u\n"}],
     "answer": "3", "task": "reward_model"},
]


def test_prompt_records_give_back_each_record_and_feed_as_a_list_of_them():
  held = prompts.PromptRecords(iter(RECORDS * 5))
  assert len(held) == 15 and list(held) == RECORDS * 5
  assert held[-1] == RECORDS[2] and held[4] == RECORDS[1]
  with pytest.raises(IndexError):
    held[15]
  feed, plain = prompts.PromptFeed(held, seed=3), prompts.PromptFeed(RECORDS * 5, seed=3)
  assert feed.take(20) == plain.take(20)  # an epoch and more, in the same order
  assert feed.state() == plain.state()  # what a checkpoint keeps
  again = prompts.PromptFeed(held, seed=3)
  again.restore(plain.state())
  assert again.take(7) == plain.take(7)


def test_prompt_records_hold_a_fraction_of_the_dicts_memory(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+{i % 97}=", "answer": str(i + i % 97)})
                          + "\n" for i in range(5000)))
  config = rl_config()
  list(prompts.iter_config_records(config, "data.jsonl", str(path)))  # imports, once

  def held_bytes(read):
    tracemalloc.start()
    try:
      held = read(prompts.iter_config_records(config, "data.jsonl", str(path)))
      return tracemalloc.get_traced_memory()[0], held
    finally:
      tracemalloc.stop()

  dicts, as_dicts = held_bytes(list)
  packed, held = held_bytes(prompts.PromptRecords)
  assert list(held) == as_dicts
  assert packed < dicts / 4, (packed, dicts)


class _Counting(CharTokenizer):
  """The char tokenizer, counting the prompts it encodes."""

  encoded = 0

  def encode_prompt(self, prompt):
    type(self).encoded += 1
    return super().encode_prompt(prompt)


def _trainer_source(config, tokenizer, positions=128):
  """RLTrainer._prompt_source, on a stand-in of the trainer's attributes it reads."""
  trainer = SimpleNamespace(config=config, tokenizer=tokenizer, tasks=[], weights=[],
                            model_config=SimpleNamespace(max_position_embeddings=positions))
  return RLTrainer._prompt_source(trainer)[0]


def _long_file(tmp_path, n=40):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": "1+" * (i % 20) + "1=", "answer": "1"}) + "\n"
                          for i in range(n)))
  config = rl_config()
  config.data.jsonl, config.rl.max_prompt_tokens = str(path), 64
  return config, path


def test_the_start_check_and_the_trainer_tokenize_each_prompt_once(tmp_path, monkeypatch):
  monkeypatch.setenv("RLAX_PS_PROMPT_CHECKS", str(tmp_path / "checks"))
  monkeypatch.setattr("rlax_ps.tokenizers.CharTokenizer", _Counting)  # the check's tokenizer
  _Counting.encoded = 0
  config, _ = _long_file(tmp_path)
  check_rl_config(config)  # `rlax-ps local`'s, before its warm start
  assert _Counting.encoded == 40
  source = _trainer_source(config, _Counting())  # its trainer's: the same records
  assert _Counting.encoded == 40 and len(source) == 40
  _trainer_source(config, _Counting(alphabet="1+=2"))  # another tokenizer checks them
  assert _Counting.encoded == 80


def test_the_trainer_names_a_prompt_past_the_models_positions_after_a_check_passed(
    tmp_path, monkeypatch):
  """A check that passed under rl.max_prompt_tokens does not pass a prompt the model's
  positions cannot hold: the trainer names the first one by its file and line."""
  monkeypatch.setenv("RLAX_PS_PROMPT_CHECKS", str(tmp_path / "checks"))
  config, path = _long_file(tmp_path)
  check_rl_config(config)
  _trainer_source(config, CharTokenizer())
  with pytest.raises(ValueError, match=rf"data.jsonl {re.escape(str(path))}:15: the model's "
                                       rf"max_position_embeddings=38 - worker.max_new_tokens"
                                       rf"=8: 30 is too small for this prompt of 31 tokens"):
    _trainer_source(config, CharTokenizer(), positions=38)


def test_a_tokenizers_fingerprint_tells_what_its_prompts_encode_to():
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  plain, templated = HFTokenizer(chat), HFTokenizer(chat, chat_template="auto")
  assert plain.fingerprint == HFTokenizer(chat).fingerprint != templated.fingerprint
  assert CharTokenizer().fingerprint != CharTokenizer(alphabet="ab").fingerprint


def test_a_tokenizers_identity_holds_across_machines_and_tells_tokenizers_apart(monkeypatch):
  """The identity a worker names in its groups (the trainer refuses another's): the same
  under another `tokenizers` version, where a prompt-length check's fingerprint is not."""
  import tokenizers
  fixtures = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")
  chat = HFTokenizer(os.path.join(fixtures, "chat_tokenizer"))
  identity, fingerprint = chat.identity, chat.fingerprint
  monkeypatch.setattr(tokenizers, "__version__", "0.0.1")
  assert chat.identity == identity and chat.fingerprint != fingerprint
  templated = HFTokenizer(os.path.join(fixtures, "chat_tokenizer"), chat_template="auto")
  other = HFTokenizer(os.path.join(fixtures, "tokenizer"))
  assert len({identity, templated.identity, other.identity}) == 3
  assert CharTokenizer().identity != CharTokenizer(alphabet="ab").identity


def _per_character(tokenizer, text, add_bos=False, add_eos=False):
  """The char tokenizer's encoding, one character at a time."""
  ids = [tokenizer.bos_id] if add_bos else []
  for pos, c in enumerate(text):
    if c not in tokenizer.vocab or c in tokenizer.specials:
      raise ValueError(f"CharTokenizer.encode: character {c!r} at position {pos} of "
                       f"{text!r} is not in the alphabet")
    ids.append(tokenizer.vocab[c])
  return ids + ([tokenizer.eos_id] if add_eos else [])


@pytest.mark.parametrize("alphabet", ["", "ab\u00e9\U0001F600 "])
@pytest.mark.parametrize("text", ["", "a", "12+34= ~", "ab\u00e9 \U0001F600ba", "1+\u00e9",
                                  "ab\x00", "a\ud83d", "a\U0010FFFF", "<bos>"])
def test_char_encoding_is_the_per_character_one(alphabet, text):
  tokenizer = CharTokenizer(alphabet) if alphabet else CharTokenizer()
  for bos, eos in [(False, False), (True, False), (False, True), (True, True)]:
    try:
      want = _per_character(tokenizer, text, bos, eos)
    except ValueError as e:
      with pytest.raises(ValueError) as got:
        tokenizer.encode(text, add_bos=bos, add_eos=eos)
      assert str(got.value) == str(e)
    else:
      assert tokenizer.encode(text, add_bos=bos, add_eos=eos) == want


def test_char_encoding_takes_a_text_at_once():
  """No step per character: encoding 20,000 of them makes a handful of calls."""
  tokenizer, calls = CharTokenizer(), []
  sys.setprofile(lambda frame, event, arg: calls.append(event))
  try:
    tokenizer.encode("12+34=" * 4000, add_bos=True)
  finally:
    sys.setprofile(None)
  assert len(calls) < 100, len(calls)

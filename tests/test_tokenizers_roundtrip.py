"""Tokenizers: char-level round trips, special ids, HF tokenizer.json through one interface."""

import json
import os
import re
import shutil

import pytest

from rlax_ps.tokenizers import CharTokenizer, HFTokenizer, make_tokenizer, tokenizer_from_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


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
  text = "rev hello world=dlrow olleh 9+9=18\n\nand\n a blank line"  # "\n\n": one piece
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


def test_a_tokenizer_config_stating_no_bos_starts_prompts_with_no_bos(tmp_path):
  # Qwen's tokenizer_config.json says "bos_token": null: transformers' tokenizer("hello
  # world").input_ids is [325, 334] for this one, with no <|endoftext|> before it.
  chat = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "chat_tokenizer")
  tok = HFTokenizer(chat)
  assert tok.bos_id is None
  assert tok.encode_prompt("hello world") == [325, 334]
  assert tok.encode("hello world", add_bos=True, add_eos=True) == [325, 334, tok.eos_id]
  # No config and a post-processor that adds nothing: transformers starts with no bos either.
  shutil.copy(os.path.join(chat, "tokenizer.json"), tmp_path / "tokenizer.json")
  assert HFTokenizer(str(tmp_path)).encode_prompt("hello world") == [325, 334]


def test_a_saved_char_tokenizer_gives_transformers_the_prompt_ids_we_train_on(tmp_path):
  # transformers' tokenizer(text) (and vLLM's) is the tokenizer.json's encode with its
  # post-processor: it must put <bos> first, as encode_prompt does.
  from tokenizers import Tokenizer
  char = CharTokenizer()
  char.save(str(tmp_path))
  saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  assert saved.encode("12+3=").ids == char.encode_prompt("12+3=")
  assert saved.decode(saved.encode("12+3=").ids) == "12+3="
  assert HFTokenizer(str(tmp_path)).encode_prompt("12+3=") == char.encode_prompt("12+3=")


def test_the_char_tokenizer_is_refused_for_a_tokenizerless_checkpoint_of_more_ids(tmp_path):
  # A model of 300 ids with no tokenizer.json is another tokenizer's: it would sample ids
  # the char tokenizer cannot decode, so the run stops before it starts, not at its first
  # decode.
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
  with pytest.raises(ValueError, match=re.escape(
      "tokenizer.kind: 'char' (the built-in character tokenizer, 99 ids) is not the tokenizer "
      f"of the checkpoint {tmp_path} (its config.json: vocab_size 300, and no tokenizer.json)")):
    tokenizer_from_config({"kind": "char"}, str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 99}))
  assert tokenizer_from_config({"kind": "char"}, str(tmp_path)).vocab_size == 99
  with pytest.raises(FileNotFoundError, match="no config.json in HF checkpoint folder"):
    tokenizer_from_config({"kind": "char"}, str(tmp_path / "nowhere"))


with open(os.path.join(FIXTURES, "hf_defaults.json")) as f:
  DEFAULTS = json.load(f)


@pytest.mark.parametrize("case", DEFAULTS["tokenizers"],
                         ids=lambda c: f"{c['post_processor']}-{c['config']}")
def test_prompt_ids_are_transformers_whatever_the_bos_settings(case, tmp_path):
  # A prompt gets the bos that tokenizer.json's post-processor adds (Llama 3's, Gemma's, or
  # none), as AutoTokenizer's encode gives it, whatever tokenizer_config.json names or its
  # add_bos_token says; a chat template's bos_token is the one the config names, or none.
  chat = os.path.join(FIXTURES, "hf", "chat_tokenizer")
  with open(os.path.join(chat, "tokenizer.json")) as f:
    tok = json.load(f)
  tok["post_processor"] = DEFAULTS["post_processors"][case["post_processor"]]
  (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
  config = DEFAULTS["tokenizer_configs"][case["config"]]
  if config is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert HFTokenizer(str(tmp_path)).encode_prompt(DEFAULTS["text"]) == case["encode"]
  templated = HFTokenizer(str(tmp_path), chat_template=os.path.join(chat, "llama3.jinja"))
  assert templated.encode_prompt(DEFAULTS["messages"]) == case["chat"]


@pytest.mark.parametrize("template, eos, stop, want", [
    ("auto", None, None, "<|im_end|>"),  # ChatML: its eos_token closes the turn
    ("gemma3.jinja", "<|endoftext|>", "<end_of_turn>", "<end_of_turn>"),
    ("llama3.jinja", "<|endoftext|>", "<|eot_id|>", "<|eot_id|>"),
    ("llama3.jinja", "<|endoftext|>", None, "<|endoftext|>"),  # <|eot_id|> stops nothing
    ("", "<|endoftext|>", "<|eot_id|>", "<|endoftext|>")])  # no template: eos
def test_the_token_that_ends_an_assistants_turn_is_its_templates_stop_token(template, eos,
                                                                           stop, want):
  """What a chat teacher scores at a response's stop: Gemma's turn ends with <end_of_turn>,
  Llama 3's with <|eot_id|>, though their eos_token may be another."""
  chat = os.path.join(FIXTURES, "hf", "chat_tokenizer")
  tok = HFTokenizer(chat, eos_token=eos, stop_tokens=[stop] if stop else (),
                    chat_template=template if template in ("auto", "") else
                    os.path.join(chat, template))
  assert tok.decode([tok.turn_end_id], skip_special=False) == want
  assert CharTokenizer().turn_end_id == CharTokenizer().eos_id


def test_a_damaged_tokenizer_file_or_config_is_a_value_error_naming_the_file(tmp_path):
  """The tokenizers package raises a plain Exception: `rlax-ps eval` printed a traceback."""
  CharTokenizer("abc").save(str(tmp_path))
  config = tmp_path / "tokenizer_config.json"
  config.write_text("{")
  with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
    HFTokenizer(str(tmp_path))
  config.unlink()
  file = tmp_path / "tokenizer.json"
  file.write_text(file.read_text()[:40])
  with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer the tokenizers"):
    HFTokenizer(str(tmp_path))


with open(os.path.join(FIXTURES, "hf", "sentencepiece_tokenizer", "expected.json")) as f:
  SENTENCEPIECE = json.load(f)


@pytest.mark.parametrize("name", sorted(SENTENCEPIECE["configs"]))
def test_a_llama_tokenizer_encodes_as_transformers_5_rebuilds_it(name, tmp_path):
  """A LlamaTokenizerFast tokenizer.json of SentencePiece's kind (Llama 2, Mistral v0.x):
  transformers 5 replaces its pipeline with its own (no normalizer; a "\u2581" before the
  first word alone unless legacy), so prompts read with the file's own pipeline came out
  otherwise than a server on transformers 5 reads them (an extra "\u2581" before a leading
  space, and after each special token of a chat)."""
  case = SENTENCEPIECE["configs"][name]
  shutil.copy(os.path.join(FIXTURES, "hf", "sentencepiece_tokenizer", "tokenizer.json"),
              tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(case["tokenizer_config"]))
  tok = HFTokenizer(str(tmp_path))
  assert [tok.encode_prompt(t) for t in SENTENCEPIECE["texts"]] == case["encode"]
  assert [tok.decode(ids) for ids in case["encode"]] == case["decode"]
  chat = HFTokenizer(str(tmp_path), chat_template="auto")
  assert chat.encode_prompt(SENTENCEPIECE["messages"]) == case["chat"]

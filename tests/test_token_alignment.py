"""Token spans of one text under two tokenizers (rlax_ps.token_alignment): the pieces of text
each token adds, the smallest spans both tokenize alike, and values shared out over them."""

import os

import numpy as np
import pytest

from rlax_ps.token_alignment import aligned_chunks, decoded_pieces, spread_over_chunks
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from tokenizer_testlib import save_byte_fallback_tokenizer, save_byte_level_tokenizer

BPE = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "tokenizer")


def test_each_token_adds_its_text_and_a_split_character_comes_whole_with_its_last_byte(
    tmp_path):
  chars = CharTokenizer()
  assert decoded_pieces(chars, chars.encode("12+34=46")) == list("12+34=46")
  bpe = HFTokenizer(BPE, bos_token="<eos>")
  assert decoded_pieces(bpe, bpe.encode("hello world")) == ["hello", " world"]
  # A special token (eos) adds no text.
  assert decoded_pieces(bpe, bpe.encode("the cat") + [bpe.eos_id]) == [
      "the", " ", "c", "a", "t", ""]
  byte = save_byte_level_tokenizer(tmp_path)
  ids = byte.encode("né à")
  assert len(ids) == 6 and decoded_pieces(byte, ids) == ["n", "", "é", " ", "", "à"]
  cut = byte.encode("né")[:-1]  # max tokens reached inside a character: its piece is kept
  assert "".join(decoded_pieces(byte, cut)) == byte.decode(cut) and byte.decode(cut) != "n"


@pytest.mark.parametrize("text", ["the fox 日本語テキスト", "x" * 30 + " 😀😀 中文字符\nok"])
def test_a_byte_fallback_tokenizers_pieces_join_to_its_text_past_the_first_tokens(
    tmp_path, text):
  """Decoding from a few tokens back started inside a character: a byte-fallback decoder
  read its bytes as U+FFFD, and every later piece was that (the teacher scored it)."""
  tokenizer = save_byte_fallback_tokenizer(tmp_path)
  ids = tokenizer.encode(text)
  assert len(ids) > 16 and tokenizer.decode(ids) == text  # (bytes, 3 or 4 a character)
  pieces = decoded_pieces(tokenizer, ids)
  assert "".join(pieces) == text and len(pieces) == len(ids)
  assert not any("\ufffd" in p for p in pieces)


def test_chunks_end_where_both_tokenizations_have_a_token_end():
  chars = list("hello world")
  mine, theirs, count = aligned_chunks(chars, ["hello", " world"])
  assert count == 2 and theirs.tolist() == [0, 1]
  assert mine.tolist() == [0] * 5 + [1] * 6
  # Neither side's ends all shared; a token of no text joins the chunk it ends in.
  mine, theirs, count = aligned_chunks(["ab", "", "c", "de"], ["a", "bcd", "e"])
  assert count == 1 and mine.tolist() == [0, 0, 0, 0] and theirs.tolist() == [0, 0, 0]
  mine, theirs, count = aligned_chunks(["ab", "c", "", "de"], ["a", "b", "cde"])
  assert count == 2 and mine.tolist() == [0, 1, 1, 1] and theirs.tolist() == [0, 0, 1]
  # Texts that differ (a tokenizer that drops what it cannot encode): one chunk.
  mine, theirs, count = aligned_chunks(["1", "+", "2"], ["12"])
  assert count == 1 and mine.tolist() == [0, 0, 0] and theirs.tolist() == [0]


def test_a_chunks_sum_is_shared_out_in_proportion_to_the_weights():
  values = np.array([-2.0, -1.0, -3.0])  # one side: chunks 0, 0, 1
  weights = np.array([-1.0, -3.0, 0.0, 0.0, -0.5])  # the other: chunks 0, 0, 1, 1, 2
  out = spread_over_chunks(values, np.array([0, 0, 1]), np.array([0, 0, 1, 1, 2]),
                           weights, 3)
  # -3 over weights 1:3; -3 over two tokens of weight 0, equally; chunk 2 has no values.
  np.testing.assert_allclose(out, [-0.75, -2.25, -1.5, -1.5, 0.0])


@pytest.mark.parametrize("text", ["hello world", "the cat gives reverse", "12+34=46"])
def test_the_policy_tokens_shares_sum_to_the_other_tokenizations_per_span(text):
  """End to end over two real tokenizers (the char one and a small BPE that drops what it
  cannot encode): whatever the spans, a response's total is kept."""
  chars, bpe = CharTokenizer(), HFTokenizer(BPE, bos_token="<eos>")
  theirs_ids = bpe.encode(text)
  mine, theirs, count = aligned_chunks(decoded_pieces(chars, chars.encode(text)),
                                       decoded_pieces(bpe, theirs_ids))
  rng = np.random.default_rng(0)
  values = -rng.random(len(theirs_ids))
  out = spread_over_chunks(values, theirs, mine, -rng.random(len(text)), count)
  assert out.shape == (len(text),)
  np.testing.assert_allclose(out.sum(), values.sum(), rtol=1e-6)
  np.testing.assert_allclose(np.bincount(mine, out, minlength=count),
                             np.bincount(theirs, values, minlength=count), rtol=1e-6)

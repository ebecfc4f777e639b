"""SFT batches: answer-only loss, packing with restarting positions, determinism per step."""

import json

import numpy as np
import pytest

from rlax_ps.tasks import Example, get_task
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train.data import SFTBatches, encode_example, pack_rows

TOK = CharTokenizer()


def test_loss_weights_cover_answer_and_eos_only():
  ids, w = encode_example(TOK, Example("12+3=", "15"))
  assert TOK.decode(ids, skip_special=False) == "<bos>12+3=15<eos>"
  assert w == [0.0] * 6 + [1.0] * 3


def test_packed_rows_restart_positions_and_mask_only_answers():
  exs = [Example("1+1=", "2"), Example("rev ab=", "ba"), Example("9+9=", "18")]
  enc = [encode_example(TOK, e) for e in exs]  # 7, 11 and 8 ids.
  batch, used = pack_rows(enc, batch_size=3, seq_len=17, pad_id=TOK.pad_id)  # 18 ids a row.
  assert used == 3
  seg, pos = batch["segment_ids"], batch["positions"]
  assert list(seg[0]) == [1] * 7 + [2] * 10  # Inputs are ids[:-1]: 17 of the 18.
  assert list(pos[0][7:10]) == [0, 1, 2]
  assert list(seg[1][:9]) == [1] * 8 + [0]  # The third example starts row 1.
  targets = batch["targets"][0][batch["loss_mask"][0] > 0]
  assert TOK.decode(targets, skip_special=False) == "2<eos>ba<eos>"
  assert batch["loss_mask"][2].sum() == 0  # Untouched row: all padding.


def test_packing_continues_on_the_next_row():
  enc = [encode_example(TOK, Example("1+1=", "2"))] * 5  # 7 ids each.
  batch, used = pack_rows(enc, batch_size=2, seq_len=15, pad_id=TOK.pad_id)
  assert used == 4  # Two per row of 16 slots.
  assert batch["loss_mask"].sum() == 4 * 2
  unpacked, used = pack_rows(enc, batch_size=2, seq_len=15, pad_id=TOK.pad_id, packing=False)
  assert used == 2 and set(unpacked["segment_ids"][0]) == {0, 1}


def test_no_loss_across_a_segment_boundary():
  enc = [encode_example(TOK, Example("a=", "b"))] * 3
  batch, _ = pack_rows(enc, batch_size=1, seq_len=12, pad_id=TOK.pad_id)
  seg, mask = batch["segment_ids"][0], batch["loss_mask"][0]
  for t in range(len(seg) - 1):
    if seg[t] != seg[t + 1]:
      assert mask[t] == 0  # The target at t belongs to another sequence.


def test_example_longer_than_a_row_is_an_error():
  enc = [encode_example(TOK, Example("123456789+1=", "123456790"))]
  with pytest.raises(ValueError, match="data.seq_len"):
    pack_rows(enc, batch_size=1, seq_len=8, pad_id=TOK.pad_id)


def test_batches_are_a_function_of_the_step():
  data = SFTBatches([get_task("addition"), get_task("reversal")], [1.0, 3.0], TOK,
                    batch_size=4, seq_len=32, seed=5)
  a, b, c = data.batch(3), data.batch(3), data.batch(4)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["tokens"], c["tokens"])
  assert a["tokens"].shape == (4, 32)
  assert (a["segment_ids"] > 0).mean() > 0.7  # Packing fills most slots.


def test_train_batches_hold_no_heldout_prompt():
  task = get_task("addition", max_digits=2)
  heldout = {e.prompt for e in task.examples("heldout", 0, 200)}
  data = SFTBatches([task], [1.0], TOK, batch_size=8, seq_len=64, seed=0)
  text = "".join(TOK.decode(r, skip_special=False) for s in range(5)
                 for r in data.batch(s)["tokens"])
  prompts = {p.split("<bos>")[-1] + "=" for p in text.split("=")[:-1]}
  assert prompts and not prompts & heldout


def test_seq_len_too_short_for_the_tasks_is_named():
  with pytest.raises(ValueError, match="data.seq_len: expected >= "):
    SFTBatches([get_task("reversal", max_len=20)], [1.0], TOK, batch_size=2, seq_len=16, seed=0)


def test_seq_len_counts_what_a_chat_template_adds_around_each_example():
  """The template's turns count against seq_len up front: a seq_len that fits the text
  alone was accepted, then the first batch drawing a long example failed mid-run."""
  import os
  from rlax_ps.tokenizers import HFTokenizer
  chat = HFTokenizer(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                                  "chat_tokenizer"), chat_template="auto")
  task = get_task("reversal", max_len=20)
  extra = len(encode_example(chat, Example("", "", task.name))[0])
  assert extra > 2  # the template's turns, beyond eos
  need = task.max_prompt_chars + task.max_answer_chars + extra - 1
  with pytest.raises(ValueError, match=f"data.seq_len: expected >= {need} "):
    SFTBatches([task], [1.0], chat, batch_size=2, seq_len=need - 1, seed=0)
  data = SFTBatches([task], [1.0], chat, batch_size=2, seq_len=need, seed=0)
  for step in range(20):  # every example drawn fits
    data.batch(step)


def _answers(batch):
  """The answers a packed batch trains on, in order."""
  text = TOK.decode(batch["targets"][batch["loss_mask"] > 0], skip_special=False)
  return [p for p in text.split("<eos>") if p]


def test_records_are_gone_through_once_an_epoch_and_a_restored_position_goes_on():
  """Every record once an epoch, each epoch in another order (drawn with replacement, a
  third of them were never seen in an epoch's worth of steps); the records a batch leaves
  over come first in the next; state() and restore() go on where the stream was."""
  records = [Example(f"{i}+1=", str(i + 1)) for i in range(30)]
  data = SFTBatches([], [], TOK, batch_size=4, seq_len=24, seed=3, records=records)
  seen = []
  while len(seen) < 90:
    seen += _answers(data.batch(0))
  for epoch in range(3):
    assert sorted(seen[30 * epoch:30 * epoch + 30], key=int) == [str(i + 1) for i in range(30)]
  assert seen[:30] != seen[30:60]  # a new order
  state = data.state()
  after = SFTBatches([], [], TOK, batch_size=4, seq_len=24, seed=3, records=records)
  after.restore(state)
  np.testing.assert_array_equal(after.batch(0)["tokens"], data.batch(0)["tokens"])


# ~13 s; test_prompts and test_resume_changes mix weighted files in the default suite
@pytest.mark.slow
def test_weighted_files_are_drawn_in_proportion_each_record_of_a_file_alike():
  """data.weights "3,1" over files of 6 and 4 records: 3 of 4 examples from the first
  (though it holds 60% of the records), each of a file's records as often as the others."""
  records = [Example(f"{i}+1=", str(i + 1)) for i in range(10)]
  data = SFTBatches([], [], TOK, batch_size=4, seq_len=24, seed=7, records=records,
                    parts=[(0, 6, 3.0), (6, 10, 1.0)])
  drawn = []
  while len(drawn) < 2400:
    drawn += [int(a) - 1 for a in _answers(data.batch(0))]
  counts = np.bincount(drawn[:2400], minlength=10)
  assert abs(counts[:6].sum() / 2400 - 0.75) < 0.03
  assert counts[:6].max() - counts[:6].min() <= 2 and counts[6:].max() - counts[6:].min() <= 2


def test_an_answer_ends_with_the_token_that_ends_the_templates_turn():
  """Gemma's template ends an assistant's turn with <end_of_turn>, its eos_token being
  another: SFT taught answer<eos> (and rendered replies after that eos), not the format the
  exported model's template and the RL workers' turns have."""
  import os
  from rlax_ps.tokenizers import HFTokenizer
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  tok = HFTokenizer(chat, eos_token="<|endoftext|>", stop_tokens=["<end_of_turn>"],
                    chat_template=os.path.join(chat, "gemma3.jinja"))
  end = tok.encode("<end_of_turn>")
  assert len(end) == 1 and end[0] != tok.eos_id
  ids, weights = encode_example(tok, Example("2+2=", "4"))
  prompt = tok.encode_prompt("2+2=")
  assert ids == prompt + tok.encode("4") + end and weights[-2:] == [1.0, 1.0]
  answer = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"}]
  ids, _ = encode_example(tok, Example("2+2=", answer))
  assert ids == (prompt + tok.encode("call") + end + tok.encode_reply(["4"], end[0])
                 + tok.encode("4") + end)
  assert tok.eos_id not in ids[len(prompt):]


def test_a_record_longer_than_seq_len_is_refused_naming_the_field():
  records = [Example("1+1=", "2"), Example("rev " + "a" * 30 + "=", "a" * 30)]
  with pytest.raises(ValueError, match=r"data.seq_len: 24 is too small for 1 of 2 records "
                                       r"\(the longest has 66 next-token pairs, record 2"):
    SFTBatches([], [], TOK, batch_size=4, seq_len=24, seed=0, records=records)


def test_a_multi_turn_demonstration_is_laid_out_as_a_rollout_with_loss_on_the_policys_turns():
  # The same ids a multi-turn rollout of that conversation has: each turn and eos, then the
  # replies as encode_reply renders them after it; the loss on the turns alone.
  import os
  from rlax_ps.tokenizers import HFTokenizer
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  answer = [{"role": "assistant", "content": "<calc>12+34</calc>"},
            {"role": "tool", "content": "46"}, {"role": "tool", "content": "again 46"},
            {"role": "assistant", "content": "46"}]
  for tok in (TOK, HFTokenizer(chat, chat_template="auto")):
    ids, weights = encode_example(tok, Example("12+34=", answer))
    first = tok.encode("<calc>12+34</calc>", add_eos=True)
    reply = tok.encode_reply(["46", "again 46"], tok.eos_id)
    last = tok.encode("46", add_eos=True)
    prompt = tok.encode_prompt("12+34=")
    assert ids == prompt + first + reply + last
    assert weights == [0.0] * len(prompt) + [1.0] * len(first) + [0.0] * len(reply) + [
        1.0] * len(last)


def test_a_demonstrations_user_turns_and_back_to_back_turns_render_as_the_template_does():
  """A user's turn between assistant turns was rendered as a tool message (every template
  that has a tool role), and two assistant turns in a row had no framing between them (the
  model trained to go on past its end of turn). Each now reads as the chat template renders
  the whole conversation, under both fixture templates."""
  import os
  from rlax_ps import chat as chat_lib
  from rlax_ps.tokenizers import HFTokenizer
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  answer = [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Italy?"},
            {"role": "assistant", "content": "Rome."},
            {"role": "assistant", "content": "Anything else?"}]
  for template, stop in (("auto", []), (os.path.join(chat, "llama3.jinja"), ["<|eot_id|>"])):
    tok = HFTokenizer(chat, chat_template=template, stop_tokens=stop)
    ids, weights = encode_example(tok, Example("Capital of France?", answer))
    whole = chat_lib.render(tok.chat_template,
                            [{"role": "user", "content": "Capital of France?"}, *answer],
                            special_tokens=tok._special, add_generation_prompt=False)
    assert whole.startswith(tok.decode(ids, skip_special=False)), (template, whole)
    trained = tok.decode([i for i, w in zip(ids, weights) if w], skip_special=False)
    assert "Italy?" not in trained and "Rome." in trained and "Anything else?" in trained


def test_demonstrations_are_supervised_data_only_and_their_roles_are_checked(tmp_path):
  from rlax_ps.train.prompts import read_prompts
  good = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"},
          {"role": "assistant", "content": "b"}]
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": "p", "answer": good}) + "\n")
  assert read_prompts(str(path), "addition", demonstrations=True)[0]["answer"] == good
  with pytest.raises(ValueError, match=r"field 'answer': expected a string, got .* \(a list of "
                                       r"messages is a multi-turn demonstration"):
    read_prompts(str(path), "addition")
  path.write_text('{"prompt": "p", "answer": [{"role": "tool", "content": "r"}]}\n')
  with pytest.raises(ValueError, match=r"d.jsonl:1: field 'answer': expected assistant turns, "
                                       r"the first and the last, .* got roles \['tool'\]"):
    read_prompts(str(path), "addition", demonstrations=True)


def test_the_held_out_line_counts_the_examples_each_task_scored():
  """It said eval.num_examples ("8 per task") where data.heldout_jsonl's records were scored,
  however many."""
  from rlax_ps.train.sft import format_accuracy
  assert format_accuracy({"math": 0.75, "addition": 0.5, "all": 0.6}, {"math": 12, "addition": 8}
                         ) == ("held-out exact match: math 75.0% of 12, addition 50.0% of 8; "
                               "all 60.0% of 20")

"""Built-in tasks: deterministic examples, disjoint splits, exact checkers, clear errors."""

import pytest

from rlax_ps.tasks import Addition, Example, Reversal, extract_answer, get_task, split_of


@pytest.mark.parametrize("name", ["addition", "reversal"])
def test_examples_are_deterministic_per_seed(name):
  task = get_task(name)
  assert task.examples("train", 7, 50) == task.examples("train", 7, 50)
  assert task.examples("train", 7, 50) != task.examples("train", 8, 50)


@pytest.mark.parametrize("name", ["addition", "reversal"])
def test_train_and_heldout_never_share_a_prompt(name):
  task = get_task(name)
  train = {e.prompt for seed in range(3) for e in task.examples("train", seed, 300)}
  heldout = {e.prompt for seed in range(3) for e in task.examples("heldout", seed, 100)}
  assert heldout and train
  assert not train & heldout
  assert all(split_of(task.name, p, task.heldout_fraction) == "heldout" for p in heldout)


def test_addition_answers_are_the_sums():
  for ex in Addition(max_digits=4).examples("train", 0, 200):
    a, b = ex.prompt.rstrip("=").split("+")
    assert int(ex.answer) == int(a) + int(b)
    assert len(a) <= 4 and len(b) <= 4


def test_reversal_answers_are_reversed():
  for ex in Reversal(min_len=2, max_len=5).examples("heldout", 0, 100):
    s = ex.prompt[len("rev "):-1]
    assert ex.answer == s[::-1]
    assert 2 <= len(s) <= 5


def test_reward_is_exact_match():
  task = Addition()
  ex = Example(prompt="12+30=", answer="42", task="addition")
  assert task.reward(ex, "42") == 1.0
  assert task.reward("42", " 42 ") == 1.0  # Outer spaces do not count.
  assert task.reward(ex, "12+30=42") == 1.0  # A completion that repeats the prompt.
  assert task.reward(ex, "42<eos>junk") == 1.0  # Text after eos is ignored.
  assert task.reward(ex, "42\n7") == 1.0
  assert task.reward(ex, "420") == 0.0
  assert task.reward(ex, "4") == 0.0
  assert task.reward(ex, "") == 0.0
  assert task.reward(ex, "x=42=42") == 0.0  # Only the text after the first "=" counts.
  # The first line is the answer: a later line's "=" is no echo of the prompt.
  assert task.reward(ex, "42\n2+2=4") == 1.0
  assert task.reward(ex, "4\n1+41=42") == 0.0


def test_extract_answer_takes_text_between_delimiter_and_eos():
  assert extract_answer("rev abc=cba<eos>zz") == "cba"
  assert extract_answer("cba") == "cba"
  assert extract_answer("\n\n 168\nmore") == "168"  # an instruct model's leading newline


def test_bad_task_arguments_name_the_field():
  with pytest.raises(ValueError, match="addition.max_digits"):
    Addition(min_digits=3, max_digits=2)
  with pytest.raises(ValueError, match="reversal.alphabet"):
    Reversal(alphabet="ab=")
  with pytest.raises(ValueError, match="reversal.alphabet: .*whitespace"):
    Reversal(alphabet="ab ")  # an answer's outer spaces would never match
  with pytest.raises(ValueError, match="heldout_fraction"):
    Addition(heldout_fraction=1.5)
  with pytest.raises(ValueError, match="unknown arguments \\['digits'\\]"):
    get_task("addition", digits=3)
  with pytest.raises(ValueError, match="'multiply'"):
    get_task("multiply")
  with pytest.raises(ValueError, match="split"):
    Addition().examples("test", 0, 3)


@pytest.mark.parametrize("name", ["addition", "reversal"])
def test_held_out_problems_are_distinct(name):
  """Drawn with replacement, short problems came again and again ('9+4=' 14 times in
  addition's 200): each weighed as many in the held-out rates."""
  task = get_task(name)
  heldout = task.examples("heldout", 1234, 200)
  assert len({e.prompt for e in heldout}) == 200
  train = task.examples("train", 0, 2000)  # (the training stream may repeat: a distribution)
  assert len({e.prompt for e in train}) < 2000


def test_tiny_problem_space_reports_instead_of_looping():
  task = Addition(min_digits=1, max_digits=1, heldout_fraction=0.01)
  with pytest.raises(RuntimeError, match="too small"):
    task.examples("heldout", 0, 5)

"""Math answer verifier: extraction, normalisation, exact comparison."""

import concurrent.futures
import os
import sys
import time
import types
from fractions import Fraction

import pytest

from algorithms.verifiers import MathAnswerVerifier, make_verifier, verifier_for_task
from algorithms.verifiers.math_answer import as_number, extract_answer, normalize_answer
from algorithms.verifiers.math_answer import MathAnswerVerifier, extract_answer

VERIFY = MathAnswerVerifier()


def test_extracts_last_boxed_with_nested_braces():
  text = "First \\boxed{1}, then finally \\boxed{\\frac{3}{\\sqrt{2}}} done"
  assert extract_answer(text) == "\\frac{3}{\\sqrt{2}}"


def test_extracts_final_answer_is_line_when_no_box():
  text = "We compute 2+2.\nSo the answer is 4.\n"
  assert extract_answer(text) == "4."
  assert extract_answer("Answer: -7") == "-7"
  assert extract_answer("no final answer here") is None
  # a line's last "answer is", not its first with the rest of the line
  assert extract_answer("Answer: after checking, the answer is 12") == "12"
  assert extract_answer("The answer is not 5. The answer is 7.") == "7."


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed 5", "5"),  # no braces, as verl reads it
    ("$\\boxed 12$.", "12"),
    ("\\boxed {7}", "7"),
    ("\\fbox{1}, then \\boxed{2}", "2"),
    ("\\boxed{1}, then \\fbox{2}", "2"),  # the last of either
    ("in \\boxed\nAnswer: 4", "4"),  # a bare mention is no box
    ("\\boxed{3\nAnswer: 4", "4"),  # a box never closed
])
def test_extracts_the_last_box_of_either_kind_with_or_without_braces(text, expected):
  assert extract_answer(text) == expected


@pytest.mark.parametrize("raw,expected", [
    ("\\dfrac{1}{2}", "1/2"),
    ("\\frac12", "1/2"),
    ("-\\frac{3}{4}", "-3/4"),
    ("$ 1,234 $", "1234"),
    ("x = 5", "x=5"),  # the variable is dropped when compared (unassigned)
    ("x = 1,234", "x=1234"),
    ("90^\\circ", "90"),
    ("90°", "90"),
    ("90\\degree", "90"),
    ("50\\%", "50"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\text{ yes }", "yes"),
    ("\\frac{\\frac{1}{2}}{3}", "(1/2)/3"),
    ("2\\frac{1}{2}", "5/2"),  # a mixed number (it read 21/2)
    ("-1\\frac{1}{3}", "-4/3"),
    ("12\\frac34", "51/4"),
    ("(2\\frac12,3)", "(5/2,3)"),
    ("1, 100", "1,100"),  # a list of two, not one thousand one hundred
])
def test_normalization(raw, expected):
  assert normalize_answer(raw) == expected


def test_numbers_compare_exactly_as_rationals():
  assert as_number("0.5") == as_number("1/2") == as_number("2/4")
  assert as_number("0.3333") != as_number("1/3")
  assert as_number("1/0") is None and as_number("\\sqrt{2}") is None


def test_numbers_in_brackets_read_only_when_the_brackets_pair_up():
  for text in ("(3", "3)", "(3)/(4", "(3)/4)", "-(3/4"):
    assert as_number(text) is None, text
  assert not VERIFY("\\boxed{(3}", "3").passed
  assert as_number("(3)") == as_number("((3))") == 3
  assert as_number("(3)/(4)") == as_number("(3/4)") == -as_number("-(3)/4") == Fraction(3, 4)


def test_numbers_longer_than_python_reads_compare_as_text():
  big = "1" * 5000  # past sys.get_int_max_str_digits()
  assert as_number(big) is None and as_number(f"{big}/2") is None and as_number(f"0.{big}") is None
  result = VERIFY(f"\\boxed{{{big}}}", big)
  assert result.passed and "symbolic" not in result.info


@pytest.mark.parametrize("completion,reference,passed", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is $1{,}000$.", "1000", True),  # LaTeX thousands separator
    ("The answer is 1,000.", "1000", True),
    ("\\boxed{3}", "3.0", True),
    ("\\boxed{3}", "4", False),
    ("\\boxed{x^2+1}", "x^2 + 1", True),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", False),
    ("I think it is 5", "5", False),  # no extractable final answer
    ("\\boxed{2\\frac{1}{2}}", "\\frac{5}{2}", True),  # mixed numbers
    ("\\boxed{12\\frac{3}{4}}", "12.75", True),
    ("\\boxed{-1\\frac{1}{3}}", "-\\frac{4}{3}", True),
    ("\\boxed{11/3}", "1\\frac{1}{3}", False),
    ("\\boxed{1100}", "1, 100", False),  # a list is no thousands separator
    ("Answer: after checking, the answer is 12", "12", True),
    ("\\boxed{90°}", "90", True),
    ("\\boxed{45\\degree}", "45^\\circ", True),
    ("\\boxed 5", "5", True),
])
def test_verifier_end_to_end(completion, reference, passed):
  result = VERIFY(completion, reference)
  assert result.passed is passed
  assert result.reward == (1.0 if passed else 0.0)


@pytest.mark.parametrize("completion,reference,passed", [
    ("\\boxed{x=2}", "y=2", False),
    ("\\boxed{y=2}", "x=2", False),
    ("\\boxed{x = 2}", "2", True),
    ("\\boxed{2}", "x=2", True),
    ("\\boxed{x=\\frac{1}{2}}", "x = 0.5", True),
    ("\\boxed{x=1,000}", "1000", True),
])
def test_a_leading_variable_is_dropped_only_against_no_equation_or_the_same_variable(
    completion, reference, passed):
  assert VERIFY(completion, reference).passed is passed


def test_an_empty_reference_is_an_error_and_an_empty_answer_matches_nothing():
  for reference in ("", " $ $ ", "\\text{}"):
    with pytest.raises(ValueError, match="reference: expected an answer"):
      VERIFY("\\boxed{}", reference)
  error = verifier_for_task("math")("\\boxed{}", "")  # a worker scores it 0, with the error
  assert not error.passed and error.info["error"].startswith("ValueError: reference")
  result = VERIFY("\\boxed{}", "x=")
  assert not result.passed and "symbolic" not in result.info


def test_registered_as_math_and_reports_what_it_saw():
  result = make_verifier("math")("\\boxed{\\tfrac{2}{4}}", "1/2")
  assert result.passed and result.info["normalized"] == "2/4" and result.info["reference"] == "1/2"


@pytest.mark.parametrize("completion,reference,passed", [
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
    ("\\boxed{1+x^2}", "x^2+1", True),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", True),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", True),
    ("\\boxed{(2,1)}", "(1,2)", False),  # an ordered pair
    ("\\boxed{x^2-1}", "x^2+1", False),
])
def test_answers_whose_strings_differ_are_compared_symbolically(completion, reference, passed):
  result = VERIFY(completion, reference)
  assert result.passed is passed and result.info["symbolic"] is passed


@pytest.mark.parametrize("completion,reference", [
    ("\\boxed{\\frac{1}{2}x}", "\\frac{1}{2x}"), ("\\boxed{\\frac{3}{4}a}", "\\frac{3}{4a}"),
    ("\\boxed{\\frac{1}{2}3}", "\\frac{1}{23}"), ("\\boxed{\\frac{1}{2}/3}", "1/\\frac{2}{3}"),
    ("\\boxed{x^2/3}", "x^\\frac{2}{3}"), ("\\boxed{x^\\frac23}", "x^2/3"),
    ("\\boxed{e^x/2}", "e^\\frac{x}{2}"), ("\\boxed{\\frac{3}{2}^2}", "3/2^2"),
])
def test_a_fraction_and_its_neighbours_do_not_read_as_another_fraction(completion, reference):
  """\\frac{a}{b} became a/b bare: \\frac{1}{2}x and \\frac{1}{2x} were one string (1/2x),
  x^\\frac{2}{3} was x^2/3, and the wrong answer passed without a symbolic check."""
  result = VERIFY(completion, reference)
  assert not result.passed and result.info["normalized"] != result.info["reference"], result.info


@pytest.mark.parametrize("completion,reference", [
    ("So the answer is \\sqrt{12}.", "2\\sqrt{3}"), ("So the answer is 1+x^2.", "x^2+1"),
    ("So the answer is \\pi/2.", "\\frac{\\pi}{2}"), ("So the answer is \\$18.", "18"),
    ("So the answer is \u22125.", "-5"), ("**Answer: 42**", "42"), ("The answer is **42**.", "42"),
    ("**Final Answer**: 42", "42"), ("Final answer: **42**", "42"), ("The answer is `42`", "42"),
])
def test_an_answer_line_closed_by_a_period_in_markdown_or_with_a_unicode_minus_is_read(
    completion, reference):
  """The symbolic checker got the sentence's period (and failed to parse), `\\$18` read as
  `\\18`, a unicode minus stayed one, and emphasis hid the answer line."""
  result = VERIFY(completion, reference)
  assert result.passed, result.info


@pytest.mark.parametrize("completion,reference,passed", [
    ("6", "6", True), ("6.", "6", True), (" 0.5 ", "1/2", True), ("x = 3", "3", True),
    ("\\frac{1}{2}", "0.5", True), ("7", "6", False), ("I think it is 5", "5", False),
    ("5\n6", "5", False), ("", "6", False), ("\\sqrt{12}", "2\\sqrt{3}", False),
])
def test_a_completion_that_is_the_answer_alone_is_scored_without_a_symbolic_check(
    completion, reference, passed):
  """A model trained on plain answers (SFT held out: records with no task) writes "6": no
  box, no answer line, so every such answer scored 0, a perfect model's too."""
  result = VERIFY(completion, reference)
  assert result.passed is passed and "symbolic" not in result.info


def test_numbers_and_equal_strings_never_ask_the_symbolic_checker():
  from algorithms.verifiers.symbolic import SymbolicEqual
  checker = SymbolicEqual()
  verify = MathAnswerVerifier(checker)
  assert verify("\\boxed{\\frac{1}{2}}", "0.5").passed
  assert not verify("\\boxed{3}", "4").passed
  assert verify("\\boxed{\\text{yes}}", "yes").passed
  assert not checker.running  # no child process was started


def test_an_answer_sympy_cannot_finish_is_not_equal_and_never_hangs_the_scorer():
  """math-verify's own timeout in the child; past the parent's wait the child is killed,
  the verdict is None (scored 0), and the next question starts a new child."""
  from algorithms.verifiers.symbolic import SymbolicEqual
  checker = SymbolicEqual(timeout_s=1)
  assert checker("5", "10^{10^{10}}") is False
  impatient = SymbolicEqual(timeout_s=60, wait_s=0.5)
  result = MathAnswerVerifier(impatient)("\\boxed{10^{10^{10}}}", "5")
  assert not result.passed and result.info["symbolic"] is None
  assert not impatient.running
  impatient.wait_s = 60.0
  assert impatient("2\\sqrt{3}", "\\sqrt{12}") is True
  impatient.close()  # a verdict given is kept: asked again, no child answers it
  assert impatient("2\\sqrt{3}", "\\sqrt{12}") is True and not impatient.running
  for c in (checker, impatient):
    c.close()


def _stall(reference: str, answer: str, timeout_s: int) -> bool:
  """A check for the children that never answers in time (as sympy on a huge answer)."""
  time.sleep(60)
  return True


def test_a_question_that_ran_out_of_time_is_not_asked_again():
  from algorithms.verifiers.symbolic import SymbolicEqual
  checker = SymbolicEqual(wait_s=0.5, children=1, check=_stall)
  assert checker("5", "(10^{10^{10}})!") is None and not checker.running
  start = time.monotonic()
  assert checker("5", "(10^{10^{10}})!") is None  # kept: no child started, no wait
  assert time.monotonic() - start < 0.4 and not checker.running
  checker.close()


def test_a_child_that_dies_as_it_starts_is_a_runtime_error_that_says_why(monkeypatch):
  """Its check cannot be imported in the child (as a script without a __main__ guard
  cannot start one): a RuntimeError naming the likely causes, not an EOFError."""
  from algorithms.verifiers.symbolic import SymbolicEqual
  module = types.ModuleType("_only_in_the_parent")

  def check(reference: str, answer: str, timeout_s: int) -> bool:
    return True

  check.__module__, check.__qualname__ = module.__name__, "check"
  module.check = check
  monkeypatch.setitem(sys.modules, module.__name__, module)
  checker = SymbolicEqual(children=1, check=check)
  with pytest.raises(RuntimeError, match="exited as it started.*__main__"):
    checker("1", "2")
  assert not checker.running


def _meet(folder: str, name: str, patience_s: int) -> bool:
  """A check for the children (a spawned child imports it from here): the question leaves
  its name in `folder` and waits up to `patience_s` for another's; True when two met."""
  import time
  open(os.path.join(folder, name), "w").close()
  deadline = time.monotonic() + patience_s
  while time.monotonic() < deadline:
    if len(os.listdir(folder)) >= 2:
      return True
    time.sleep(0.01)
  return False


@pytest.mark.parametrize("children,verdicts", [(2, [True, True]), (1, [False, True])])
def test_the_children_answer_side_by_side(tmp_path, children, verdicts):
  """Two scoring threads' questions, each answered only once the other is being answered:
  two children answer both; one child answers them in turn (the first gives up waiting)."""
  from algorithms.verifiers.symbolic import SymbolicEqual
  checker = SymbolicEqual(timeout_s=30 if children == 2 else 1, wait_s=120,
                          children=children, check=_meet)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    got = list(pool.map(lambda name: checker(str(tmp_path), name), ["a", "b"]))
  assert sorted(got) == verdicts
  checker.close()
  assert not checker.running
  with pytest.raises(ValueError, match="children: expected >= 1"):
    SymbolicEqual(children=0)


def test_a_completion_that_revises_its_answer_is_scored_on_its_last_answer_line():
  text = "The answer is 5.\nWait, that is wrong: 3 + 4 = 7.\nSo the answer is 7."
  assert extract_answer(text) == "7."
  assert MathAnswerVerifier()(text, "7").reward == 1.0
  assert MathAnswerVerifier()(text, "5").reward == 0.0

"""Math answer verifier: extraction, normalisation, exact comparison."""

import concurrent.futures
import os

import pytest

from algorithms.verifiers import MathAnswerVerifier, make_verifier
from algorithms.verifiers.math_answer import as_number, extract_answer, normalize_answer

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


@pytest.mark.parametrize("raw,expected", [
    ("\\dfrac{1}{2}", "1/2"),
    ("\\frac12", "1/2"),
    ("-\\frac{3}{4}", "-3/4"),
    ("$ 1,234 $", "1234"),
    ("x = 5", "5"),
    ("90^\\circ", "90"),
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
])
def test_verifier_end_to_end(completion, reference, passed):
  result = VERIFY(completion, reference)
  assert result.passed is passed
  assert result.reward == (1.0 if passed else 0.0)


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

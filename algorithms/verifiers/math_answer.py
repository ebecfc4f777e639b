"""Math final-answer verifier: extract the answer, normalise it, compare it exactly, else
symbolically.

The answer is the last `\\boxed{...}` (or `\\fbox{...}`) of the completion, else the
text after the last "answer is" / "answer:" on its line. Normalisation drops `$`,
spacing commands, `\\left`/`\\right`, `\\text{}` wrappers, degree signs, percent signs and
a leading "x =", turns `\\frac{a}{b}`/`\\dfrac`/`\\tfrac` into a/b (a mixed number
2\\frac{1}{2} into 5/2) and strips thousands separators (not a list's ", "); then both
sides are compared as exact rationals when they parse as numbers (so 0.5 == 1/2 ==
\\frac{1}{2}), else as normalised strings and, where those differ,
symbolically (math-verify: \\sqrt{12} == 2\\sqrt{3}, x^2+1 == 1+x^2, sets, intervals).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from algorithms.verifiers.base import VerifierResult, register_verifier
from algorithms.verifiers.symbolic import SymbolicEqual

# (the greedy .* takes a line's last "answer is", not the first with the rest of the line)
_ANSWER_LINE = re.compile(r".*answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)


def _braced(text: str, start: int) -> tuple[str, int] | None:
  """The content of the brace group opening at text[start] == '{', and the index after it."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return text[start + 1:i], i + 1
  return None


def extract_answer(completion: str) -> str | None:
  """The final answer of a completion, or None when it gives none."""
  for command in ("\\boxed", "\\fbox"):
    pos = completion.rfind(command + "{")
    if pos >= 0:
      got = _braced(completion, pos + len(command))
      if got is not None:
        return got[0].strip()
  for line in reversed(completion.strip().splitlines()):
    match = _ANSWER_LINE.match(line)
    if match:
      return match.group(1).strip()
  return None


def _replace_frac(s: str) -> str:
  """\\frac{a}{b} -> (a)/(b), also the \\frac12 shorthand; nested fractions included."""
  while True:
    pos = s.find("\\frac")
    if pos < 0:
      return s
    rest = pos + len("\\frac")
    parts = []
    for _ in range(2):
      if rest < len(s) and s[rest] == "{":
        got = _braced(s, rest)
        if got is None:
          return s
        parts.append(got[0])
        rest = got[1]
      elif rest < len(s):
        parts.append(s[rest])
        rest += 1
      else:
        return s
    num, den = parts
    # a mixed number, 2\frac{1}{2}: a whole number alone before it (not an exponent's 2)
    whole = re.search(r"(?:^|(?<=[(\[{=+,:;]))(-?)(\d+)$", s[:pos])
    if whole and re.fullmatch(r"\d+", num) and re.fullmatch(r"[1-9]\d*", den):
      value = int(whole.group(2)) * int(den) + int(num)
      s = s[:whole.start()] + f"{whole.group(1)}{value}/{den}" + s[rest:]
      continue
    num = num if re.fullmatch(r"-?[\w.]+", num) else f"({num})"
    den = den if re.fullmatch(r"[\w.]+", den) else f"({den})"
    s = s[:pos] + f"{num}/{den}" + s[rest:]


def normalize_answer(answer: str) -> str:
  """A canonical string for an answer (see the module docstring)."""
  s = answer.strip()
  s = re.sub(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}",
             lambda m: m.group(1) if m.group(1) is not None else m.group(2), s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\displaystyle"):
    s = s.replace(token, "")
  s = re.sub(r"\^\{?\\circ\}?", "", s).replace("\\%", "").replace("%", "")
  listed = re.search(r",\s", s)  # "1, 100": two numbers, not one thousand one hundred
  s = re.sub(r"\s+", "", s).replace("{,}", ",")
  s = s.rstrip(".")
  s = re.sub(r"^[a-zA-Z]=", "", s)
  if not listed and re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  s = _replace_frac(s)
  return s


def as_number(s: str) -> Fraction | None:
  """An exact rational for integers, decimals and a/b of them (with signs), else None."""
  m = re.fullmatch(r"\(?([+-]?\d+(?:\.\d+)?|[+-]?\.\d+)\)?(?:/\(?(\d+(?:\.\d+)?)\)?)?", s)
  if m is None:
    m2 = re.fullmatch(r"-\((\d+(?:\.\d+)?)\)/\(?(\d+(?:\.\d+)?)\)?", s)
    if m2 is None:
      return None
    return -Fraction(m2.group(1)) / Fraction(m2.group(2))
  value = Fraction(m.group(1))
  if m.group(2) is not None:
    den = Fraction(m.group(2))
    if den == 0:
      return None
    value /= den
  return value


_SHARED: SymbolicEqual | None = None


def shared_symbolic() -> SymbolicEqual:
  """The process's one symbolic checker (its children started as first asked)."""
  global _SHARED
  if _SHARED is None:
    _SHARED = SymbolicEqual()
  return _SHARED


@register_verifier("math")
class MathAnswerVerifier:
  """1.0 when the completion's final answer equals the reference (see the module docstring;
  `symbolic`: the checker of answers whose normalised strings differ, default the process's
  shared one), else 0.0 (also when no answer can be extracted, or the symbolic check ran
  out of time: info["symbolic"] None)."""

  def __init__(self, symbolic: SymbolicEqual | None = None):
    self.symbolic = symbolic

  def __call__(self, completion: str, reference: Any) -> VerifierResult:
    extracted = extract_answer(completion)
    ref = normalize_answer(str(reference))
    if extracted is None:
      return VerifierResult(0.0, False, {"extracted": None, "reference": ref})
    pred = normalize_answer(extracted)
    info = {"extracted": extracted, "normalized": pred, "reference": ref}
    a, b = as_number(pred), as_number(ref)
    if a is not None and b is not None:  # two numbers: decided exactly
      equal = a == b
    elif pred == ref:
      equal = True
    else:
      verdict = (self.symbolic or shared_symbolic())(str(reference).strip(), extracted)
      info["symbolic"] = verdict
      equal = bool(verdict)
    return VerifierResult(1.0 if equal else 0.0, bool(equal), info)

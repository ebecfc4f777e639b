"""Math final-answer verifier: extract the answer, normalise it, compare it exactly, else
symbolically.

The answer is the last `\\boxed{...}` or `\\fbox{...}` of the completion (`\\boxed 5`: the
text up to the next `$` or line end), else the text after the last "answer is" /
"answer:" on its line (markdown emphasis around either dropped). Normalisation drops `$`
and `\\$`, spacing commands, `\\left`/`\\right`, `\\text{}` wrappers, degree signs (`^\\circ`,
`\\degree`, `°`) and percent signs, reads a unicode minus as "-", turns
`\\frac{a}{b}`/`\\dfrac`/`\\tfrac` into a/b (each part in brackets unless a number, the whole
where a neighbour would join it: (1/2)x, x^(2/3); a mixed number 2\\frac{1}{2} into 5/2) and
strips thousands separators (not a list's ", "). A leading "x =" is dropped where the other
side has no "=", and from both where both name the same variable (x=2 is not y=2). Then
both sides are compared as exact rationals when they parse as numbers (so 0.5 == 1/2 ==
\\frac{1}{2}), else as normalised strings and, where those differ, symbolically
(math-verify: \\sqrt{12} == 2\\sqrt{3}, x^2+1 == 1+x^2, sets, intervals). A completion with
neither a box nor an answer line passes only where it is the answer alone, one line equal to
the reference as a number or normalised string (no symbolic check): "6", not "I think 6".
An empty answer matches nothing; an empty reference is a ValueError.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from algorithms.verifiers.base import VerifierResult, register_verifier
from algorithms.verifiers.symbolic import SymbolicEqual

# (the greedy .* takes a line's last "answer is", not the first with the rest of the line)
_ANSWER_LINE = re.compile(r".*answer[*_\s]*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
# markdown emphasis around an answer line's answer: **42**, `42`, **42**.
_EMPHASIS = re.compile(r"^[*_`]+|[*_`]+(?=\.?$)")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_VARIABLE = re.compile(r"([a-zA-Z])=(.*)")  # a normalised "x=..."
_SIGNED = r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)"
_UNSIGNED = r"\d+(?:\.\d+)?"
# a number, or a/b of them, each alone or in its own pair of brackets ("-(3)" too)
_NUMBER = re.compile(rf"(?:({_SIGNED})|(-?)\(({_SIGNED})\))"
                     rf"(?:/(?:({_UNSIGNED})|\(({_UNSIGNED})\)))?")


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
  boxes = list(_BOX.finditer(completion))
  if boxes:  # the last box decides; one never closed (a cut-off completion) gives none
    rest = completion[boxes[-1].end():]
    if rest.lstrip().startswith("{"):
      got = _braced(rest, rest.index("{"))
      if got is not None:
        return got[0].strip()
    else:  # `\boxed 5` (as verl reads it): up to the next `$` or the line's end
      bare = re.match(r"[ \t]+([^$\n]*)", rest)
      if bare and bare.group(1).strip():
        return bare.group(1).strip()
  for line in reversed(completion.strip().splitlines()):
    match = _ANSWER_LINE.match(line)
    if match and (answer := _EMPHASIS.sub("", match.group(1).strip()).strip()):
      return answer
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
    # Each part bracketed unless a number, the whole where a neighbour would join it:
    # \frac{1}{2x} is not \frac{1}{2}x, nor x^\frac{2}{3} x^2/3 (they read alike as a/b).
    num = num if re.fullmatch(rf"-?{_UNSIGNED}", num) else f"({num})"
    den = den if re.fullmatch(_UNSIGNED, den) else f"({den})"
    value = f"{num}/{den}"
    if re.search(r"[\w^/)]$", s[:pos]) or re.match(r"[\w(^]", s[rest:]):
      value = f"({value})"
    s = s[:pos] + value + s[rest:]


def normalize_answer(answer: str) -> str:
  """A canonical string for an answer (see the module docstring)."""
  s = answer.strip().replace("\u2212", "-")  # (a unicode minus)
  s = re.sub(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}",
             lambda m: m.group(1) if m.group(1) is not None else m.group(2), s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$",
                "\\displaystyle"):
    s = s.replace(token, "")
  s = re.sub(r"\^\{?\\circ\}?|\\degree(?![a-zA-Z])|°", "", s).replace("\\%", "").replace("%", "")
  listed = re.search(r",\s", s)  # "1, 100": two numbers, not one thousand one hundred
  s = re.sub(r"\s+", "", s).replace("{,}", ",")
  s = s.rstrip(".")
  prefix = s[:2] if _VARIABLE.fullmatch(s) else ""  # "x=" kept (see unassigned)
  s = s[len(prefix):]
  if not listed and re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  s = _replace_frac(s)
  return prefix + s


def unassigned(pred: str, ref: str) -> tuple[str, str]:
  """Two normalised answers less a leading "x=": from one side where the other has no "=",
  from both where both name the same variable (different ones are kept: x=2 is not y=2)."""
  p, r = _VARIABLE.fullmatch(pred), _VARIABLE.fullmatch(ref)
  if p and r:
    return (p.group(2), r.group(2)) if p.group(1) == r.group(1) else (pred, ref)
  if p and "=" not in ref:
    return p.group(2), ref
  if r and "=" not in pred:
    return pred, r.group(2)
  return pred, ref


def as_number(s: str) -> Fraction | None:
  """An exact rational for integers, decimals and a/b of them (with signs, in brackets that
  pair up), else None (also for one of more digits than Python reads: compared as text)."""
  m = _NUMBER.fullmatch(s)
  if m is None and s.startswith("(") and s.endswith(")"):  # (3/4)
    m = _NUMBER.fullmatch(s[1:-1])
  if m is None:
    return None
  num, neg, bracketed, den, bracketed_den = m.groups()
  try:  # (a ValueError past sys.get_int_max_str_digits())
    value = Fraction(num) if num is not None else Fraction(bracketed) * (-1 if neg else 1)
    den = Fraction(den if den is not None else bracketed_den or 1)
  except ValueError:
    return None
  return None if den == 0 else value / den


def _as_written(answer: str) -> str:
  """An answer for the symbolic checker: a sentence's closing period and a unicode minus
  (which it cannot parse) dropped, what it was written as otherwise."""
  return answer.strip().rstrip(".,;").strip().replace("\u2212", "-")


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
    ref = normalize_answer(str(reference))
    if not ref:  # every empty answer would match it
      raise ValueError(f"reference: expected an answer, got {reference!r} (empty once normalised)")
    extracted = extract_answer(completion)
    alone = extracted is None  # the completion may be the answer alone (an SFT model's "6")
    if alone and "\n" in completion.strip():
      return VerifierResult(0.0, False, {"extracted": None, "reference": ref})
    pred = normalize_answer(completion if alone else extracted)
    info = {"extracted": extracted, "normalized": pred, "reference": ref}
    p, r = unassigned(pred, ref)
    a, b = as_number(p), as_number(r)
    if not p or not r:  # \boxed{}, "x=": no answer
      equal = False
    elif a is not None and b is not None:  # two numbers: decided exactly
      equal = a == b
    elif p == r:
      equal = True
    elif alone:  # no answer it marked: equal as written or not at all
      equal = False
    else:
      verdict = (self.symbolic or shared_symbolic())(_as_written(str(reference)),
                                                      _as_written(extracted))
      info["symbolic"] = verdict
      equal = bool(verdict)
    return VerifierResult(1.0 if equal else 0.0, bool(equal), info)

"""A format reward for reasoning models (DeepSeek-R1 / open-r1 style): `think_format`.

The rule, exactly: the completion starts with `<think>` (nothing before it, whitespace
included), holds no other `<think>` and exactly one `</think>` (TRL's
`trl.rewards.think_format_reward`: `^<think>(?!.*<think>)(.*?)</think>.*$`, plus the single
close); the text after `</think>`, stripped of surrounding whitespace, is the answer and
must not be empty. An answer with an `<answer>` or `</answer>` tag must be one
`<answer>...</answer>` block and nothing else, its content non-empty once stripped
(open-r1's `format_reward` block, without its fixed newlines). Reward 1.0, else 0.0.
"""

from __future__ import annotations

from typing import Any

from algorithms.verifiers.base import VerifierResult, register_verifier

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def think_format_reward(completion: str) -> float:
  """1.0 when `completion` is `<think>...</think>` and a non-empty answer (the module's
  rule), else 0.0."""
  if (not completion.startswith(THINK_OPEN) or completion.count(THINK_OPEN) != 1
      or completion.count(THINK_CLOSE) != 1):
    return 0.0
  answer = completion.split(THINK_CLOSE, 1)[1].strip()
  if ANSWER_OPEN in answer or ANSWER_CLOSE in answer:
    if (not (answer.startswith(ANSWER_OPEN) and answer.endswith(ANSWER_CLOSE))
        or answer.count(ANSWER_OPEN) != 1 or answer.count(ANSWER_CLOSE) != 1):
      return 0.0
    answer = answer[len(ANSWER_OPEN):-len(ANSWER_CLOSE)].strip()
  return 1.0 if answer else 0.0


@register_verifier("think_format")
class ThinkFormatVerifier:
  """`think_format_reward` as a verifier (the reference is not read); passed when 1.0. Most
  useful as a weighted term beside a prompt's own verifier (worker.reward_terms)."""

  def __call__(self, completion: str, reference: Any = None) -> VerifierResult:
    reward = think_format_reward(completion)
    return VerifierResult(reward=reward, passed=reward == 1.0)

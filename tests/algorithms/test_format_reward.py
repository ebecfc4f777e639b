"""The think_format reward: `<think>...</think>` then a non-empty answer, optionally one
`<answer>...</answer>` block (TRL's think_format_reward, open-r1's answer block)."""

import pytest

from algorithms.verifiers import VerifierResult, make_verifier, think_format_reward


@pytest.mark.parametrize("completion", [
    "<think>\nsome reasoning\n</think>\nThe answer is 4.",  # TRL's docstring example
    "<think>\nreasoning\n</think>\n<answer>\n4\n</answer>",  # open-r1's layout
    "<think></think>4",  # an empty thought, as TRL's (.*?) allows
    "<think>a</think>  <answer> 4 </answer>\n",
])
def test_a_thought_then_an_answer_scores_one(completion):
  assert think_format_reward(completion) == 1.0


@pytest.mark.parametrize("completion", [
    "<think>\nreasoning\nThe answer is 4.",  # TRL's docstring example: never closed
    " <think>a</think>4",  # something before the opening tag
    "So: <think>a</think>4",
    "<think>a</think>",  # no answer
    "<think>a</think> \n ",
    "<think>a<think>b</think>4",  # a second opening tag
    "<think>a</think>4</think>",  # a second closing tag
    "<think>a</think><answer> </answer>",  # an empty answer block
    "<think>a</think>4 <answer>4</answer>",  # text outside the answer block
    "<think>a</think><answer>4",  # an unclosed answer block
    "<think>a</think><answer>4</answer><answer>5</answer>",
    "",
])
def test_anything_else_scores_zero(completion):
  assert think_format_reward(completion) == 0.0


def test_it_is_registered_as_think_format_and_passes_on_one():
  verify = make_verifier("think_format")
  assert verify("<think>a</think>4", "ignored") == VerifierResult(1.0, True)
  assert verify("4", "4") == VerifierResult(0.0, False)

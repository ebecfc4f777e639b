"""Reward verifiers behind one interface: `make_verifier(name)(completion, reference)`.

Registered: "math" (final-answer match), "code" (sandboxed test execution), "think_format"
(a `<think>...</think>` answer layout, for worker.reward_terms) and "task:<name>" for the
built-in synthetic tasks of `rlax_ps.tasks`; `load_verifiers` imports a user's files or
modules that register more. Prompts of task `reward_model` are scored by
the worker's reward model instead.
"""

from algorithms.verifiers.base import (REWARD_MODEL_TASK, VERIFIERS, Verifier, VerifierResult, known_tasks,
                                       load_verifiers, make_verifier, reference_check,
                                       register_verifier, verifier_for_task, verifiers_by_task)
from algorithms.verifiers.code_exec import CodeExecutionVerifier
from algorithms.verifiers.format_reward import ThinkFormatVerifier, think_format_reward
from algorithms.verifiers.math_answer import MathAnswerVerifier
from algorithms.verifiers.tasks import TaskVerifier, task_verifier

__all__ = ["REWARD_MODEL_TASK", "VERIFIERS", "Verifier", "VerifierResult", "known_tasks", "load_verifiers",
           "make_verifier", "reference_check", "register_verifier", "verifier_for_task", "verifiers_by_task",
           "CodeExecutionVerifier", "MathAnswerVerifier", "TaskVerifier", "ThinkFormatVerifier",
           "task_verifier", "think_format_reward"]

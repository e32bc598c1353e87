"""The verifiable tasks: deterministic sampling, a held-out set disjoint from training, exact scoring."""

import numpy as np
import pytest

from plexrl.models import CharTokenizer
from plexrl.models.tokenizer import EOS_TOKEN
from plexrl.tasks import EVAL_SIZE, TASKS, Problem, Task, get_task, is_held_out

TASK_NAMES = sorted(TASKS)
MODEL_POSITIONS = 1024  # the shipped model's max_position_embeddings


@pytest.fixture(params=TASK_NAMES)
def task(request: pytest.FixtureRequest) -> Task:
    return TASKS[request.param]


def test_the_required_tasks_exist() -> None:
    assert {"add", "mul", "rev", "sum"} <= set(TASKS)
    assert all(TASKS[name].name == name for name in TASKS)


def test_sampling_is_deterministic_given_the_seed(task: Task) -> None:
    first = task.sample(50, np.random.default_rng(7))
    again = task.sample(50, np.random.default_rng(7))
    other = task.sample(50, np.random.default_rng(8))
    assert first == again
    assert first != other


def test_the_eval_set_is_fixed_distinct_and_held_out(task: Task) -> None:
    problems = task.eval_set()
    assert problems == task.eval_set()
    assert len(problems) == EVAL_SIZE
    assert len({p.prompt for p in problems}) == EVAL_SIZE
    assert all(is_held_out(p.prompt) for p in problems)


def test_the_eval_set_is_disjoint_from_training_problems(task: Task) -> None:
    training = {p.prompt for p in task.sample(2000, np.random.default_rng(0))}
    assert training.isdisjoint(p.prompt for p in task.eval_set())


@pytest.mark.parametrize(
    ("name", "prompt", "answer"),
    [
        ("add", "123+45=", "168"),
        ("mul", "37*6=", "222"),
        ("rev", "rev:abcde=", "edcba"),
        ("sum", "sum:12+7+45+3=", "12+7=19,19+45=64,64+3=67>67"),
    ],
)
def test_problems_have_the_documented_format(name: str, prompt: str, answer: str) -> None:
    task = get_task(name)
    drawn = task.sample(200, np.random.default_rng(0))
    assert all(p.prompt.endswith("=") for p in drawn)
    assert task.score(Problem(prompt=prompt, answer=answer), answer) == 1.0


def test_answers_are_right() -> None:
    for p in get_task("add").sample(100, np.random.default_rng(0)):
        a, b = p.prompt[:-1].split("+")
        assert int(p.answer) == int(a) + int(b)
    for p in get_task("mul").sample(100, np.random.default_rng(0)):
        a, b = p.prompt[:-1].split("*")
        assert int(p.answer) == int(a) * int(b)
    for p in get_task("rev").sample(100, np.random.default_rng(0)):
        assert p.prompt == f"rev:{p.answer[::-1]}="
    for p in get_task("sum").sample(100, np.random.default_rng(0)):
        terms = [int(t) for t in p.prompt[len("sum:") : -1].split("+")]
        steps, total = p.answer.split(">")
        assert int(total) == sum(terms)
        for i, step in enumerate(steps.split(",")):  # running total + next term = new running total
            assert step == f"{sum(terms[: i + 1])}+{terms[i + 1]}={sum(terms[: i + 2])}"


def test_the_right_answer_scores_one_and_a_wrong_one_zero(task: Task) -> None:
    problem = task.eval_set()[0]
    assert task.score(problem, problem.answer) == 1.0
    assert task.score(problem, problem.answer + "1") == 0.0
    assert task.score(problem, problem.answer[:-1]) == 0.0
    assert task.score(problem, "") == 0.0


def test_scoring_ignores_whitespace_and_anything_after_eos(task: Task) -> None:
    problem = task.eval_set()[0]
    assert task.score(problem, f" {problem.answer} \n") == 1.0
    assert task.score(problem, f"{problem.answer}{EOS_TOKEN}9x{EOS_TOKEN}") == 1.0
    assert task.score(problem, f"{EOS_TOKEN}{problem.answer}") == 0.0


def test_every_problem_encodes_and_its_answer_fits_the_tasks_token_budget(task: Task) -> None:
    tok = CharTokenizer()
    for p in [*task.eval_set(), *task.sample(500, np.random.default_rng(0))]:
        answer = [*tok.encode(p.answer, bos=False), tok.eos_id]
        ids = [*tok.encode(p.prompt), *answer]
        assert len(answer) <= task.max_tokens
        assert len(tok.encode(p.prompt)) + task.max_tokens <= MODEL_POSITIONS
        assert tok.decode(ids) == p.prompt + p.answer


def test_sum_checks_only_the_final_total() -> None:
    task = get_task("sum")
    problem = Problem("sum:12+7+45+3=", "12+7=19,19+45=64,64+3=67>67")
    assert task.score(problem, "12+7=20,20+45=65,65+2=67>67") == 1.0  # slips that cancel: the verifier sees 67
    assert task.score(problem, "12+7=19,19+45=64,64+3=68>68") == 0.0
    assert task.score(problem, "67") == 0.0  # no answer mark
    assert task.score(problem, f"x>67{EOS_TOKEN}>1") == 1.0  # cut at EOS


def test_sum_solutions_have_a_heavy_tailed_length() -> None:
    lengths = np.array([len(p.answer) + 1 for p in get_task("sum").sample(3000, np.random.default_rng(0))])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert lengths.min() <= 12 and p50 <= 50  # most are short ...
    assert p99 >= 200 and lengths.max() >= 300  # ... and a few run to hundreds of tokens


def test_an_unknown_task_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid tasks: add, mul, rev, sum"):
        get_task("sort")

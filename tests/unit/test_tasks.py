"""The verifiable tasks: deterministic sampling, a held-out set disjoint from training, exact scoring."""

import numpy as np
import pytest

from plexrl.models import CharTokenizer
from plexrl.tasks import EVAL_SIZE, TASKS, Problem, Task, get_task

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
    assert all(task.held_out(p) for p in problems)


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
        ("chat", "User: What is 4 + 5?\n\nAssistant: 9\n\nUser: What is 37 + 12?\n\nAssistant:", " 49\n\nUser:"),
    ],
)
def test_problems_have_the_documented_format(name: str, prompt: str, answer: str) -> None:
    task = get_task(name)
    drawn = task.sample(200, np.random.default_rng(0))
    assert all(p.prompt.endswith(prompt[-1]) for p in drawn)
    assert task.score(Problem(prompt=prompt, answer=answer), answer) == 1.0


def test_answers_are_right() -> None:
    for p in get_task("add").sample(100, np.random.default_rng(0)):
        a, b = p.prompt[:-1].split("+")
        assert int(p.answer) == int(a) + int(b)
    for p in get_task("mul").sample(100, np.random.default_rng(0)):
        a, b = p.prompt[:-1].split("*")
        assert int(p.answer) == int(a) * int(b)
    for p in get_task("chat").sample(100, np.random.default_rng(0)):
        a, b = p.prompt.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
        assert p.answer == f" {int(a) + int(b)}\n\nUser:" and 0 <= int(a) <= 100 and 0 <= int(b) <= 100
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


def test_scoring_ignores_surrounding_whitespace(task: Task) -> None:
    problem = task.eval_set()[0]
    assert task.score(problem, f" {problem.answer} \n") == 1.0
    assert task.score(problem, f"{problem.answer} 9x") == 0.0


def test_every_problem_encodes_and_its_answer_fits_the_tasks_token_budget(task: Task) -> None:
    tok = CharTokenizer()
    for p in [*task.eval_set(), *task.sample(500, np.random.default_rng(0))]:
        answer = [*tok.encode(p.answer, add_special_tokens=False), tok.eos_token_id]
        ids = [*tok.encode(p.prompt), *answer]
        assert len(answer) <= task.max_tokens
        assert len(tok.encode(p.prompt)) + task.max_tokens <= MODEL_POSITIONS
        assert tok.decode(ids, skip_special_tokens=True) == p.prompt + p.answer


def test_sum_checks_only_the_final_total() -> None:
    task = get_task("sum")
    problem = Problem("sum:12+7+45+3=", "12+7=19,19+45=64,64+3=67>67")
    assert task.score(problem, "12+7=20,20+45=65,65+2=67>67") == 1.0  # slips that cancel: the verifier sees 67
    assert task.score(problem, "12+7=19,19+45=64,64+3=68>68") == 0.0
    assert task.score(problem, "67") == 0.0  # no answer mark


def test_sum_solutions_have_a_heavy_tailed_length() -> None:
    lengths = np.array([len(p.answer) + 1 for p in get_task("sum").sample(3000, np.random.default_rng(0))])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert lengths.min() <= 12 and p50 <= 50  # most are short ...
    assert p99 >= 200 and lengths.max() >= 300  # ... and a few run to hundreds of tokens


def test_an_unknown_task_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid tasks: add, chat, mul, rev, search, sum"):
        get_task("sort")


def test_the_search_corpus_is_fixed_and_bm25_finds_each_entitys_own_document_first() -> None:
    from plexrl.tasks import search

    docs = search.corpus()
    assert docs == search.world().documents and len({d.title for d in docs}) == len(docs)  # every name unique
    found = search.retriever()
    for doc in docs:
        assert found.search(doc.title)[0] == doc  # the title is named twice in its own document
    assert found.search("") == [] and found.search("nobody") == []
    assert search.information("nobody") == "<information>no results</information>\n"
    task = get_task("search")  # a search that found nothing is a failed tool call
    assert not task.observation_ok(search.information("nobody"))
    assert task.observation_ok(search.information(docs[0].title))


def test_search_questions_need_one_to_three_searches_and_the_reference_follows_the_environment() -> None:
    task = get_task("search")
    hops = set()
    for p in task.sample(300, np.random.default_rng(1)):
        segments = task.segments(p)
        assert "".join(text for text, _ in segments) == p.answer
        response = ""
        for text, learned in segments:
            if not learned:  # what the environment returned is exactly what it returns now
                assert text == task.respond(p, response)
            response += text
        assert task.respond(p, response) is None  # the answer ends the trajectory
        hops.add(sum(not learned for _, learned in segments))
    assert hops == {1, 2, 3}


def test_search_answers_are_exact_match_of_the_last_answer_and_held_out_people_stay_out() -> None:
    from plexrl.tasks import search

    task = get_task("search")
    problem = task.eval_set()[0]
    want = search.last_answer(problem.answer)
    assert want is not None
    assert task.score(problem, f"<search>x</search>\n<answer>wrong</answer>\n<answer>The {want}!</answer>") == 1.0
    assert task.score(problem, f"<answer>{want}</answer>\n<answer>wrong</answer>") == 0.0
    assert task.score(problem, f"<search>{want}</search>\n") == 0.0  # no answer given
    people = {search._person(p) for p in task.sample(3000, np.random.default_rng(0))}
    assert people.isdisjoint(search._person(p) for p in task.eval_set())

"""A search agent's task (Search-R1's format) over a corpus of facts about fictional entities.

    ask:who rules the land where zorvan lives=
    <search>zorvan</search>                               <- the model's turn, ended by a newline
    <information>zorvan: zorvan lives in pelmora and works as a baker, ...</information>
    <search>pelmora</search>
    <information>pelmora: pelmora is a city in tesk, ...</information>
    <search>tesk</search>
    <information>tesk: tesk is a land ruled by mara, ...</information>
    <answer>mara</answer>                                 <- then EOS

The corpus (:func:`corpus`) is generated from a fixed seed: people, each living in a city and
working a job; cities, each in a land; lands, each with a ruler. Every name is made up, so a
question can only be answered by searching. Questions need 1 to 3 searches (a person's job or
city: 1; their land: 2; its ruler: 3). Retrieval is BM25 (``rank-bm25``'s Okapi BM25: numpy only,
and the corpus is a few hundred documents, so a faster index would buy nothing) over the
documents' words; a result shows the top :data:`TOP_K` documents. The reward is exact match of
the last ``<answer>`` in the response (SQuAD normalisation: lower case, no punctuation or articles).

Held out by person: a tenth of the people (by a stable hash of their name) appear only in the
evaluation set, so no held-out answer is ever seen in training.
"""

from __future__ import annotations

import functools
import re
import string
import zlib
from dataclasses import dataclass

import numpy as np

from plexrl.tasks._base import Problem, Task

TOP_K = 2  # documents per search result
NO_RESULTS = "no results"  # the information of a search that found nothing
SEED = 20261201  # the corpus's: change it and every question changes
TURN_END = "\n"  # ends each of the model's turns; the environment answers a search after it
MAX_TURNS = 4  # searches and the answer
_SYLLABLES = ("ka", "ro", "mi", "zen", "tal", "vor", "eth", "lun", "pa", "qui", "sor", "bel", "dra", "fen", "gil",
              "hor", "jun", "mak", "nel", "oth", "rin", "sil", "tur", "wex", "yor", "bim", "cas", "dov")  # fmt: skip
_JOBS = ("baker", "smith", "miner", "tailor", "farmer", "potter", "weaver", "sailor", "singer", "healer",
         "hunter", "scribe")  # fmt: skip
PEOPLE, CITIES, LANDS = 600, 40, 12


@dataclass(frozen=True)
class Document:
    title: str
    text: str  # what a search result shows, title first


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    job: str


@dataclass(frozen=True)
class World:
    """The facts behind the corpus."""

    people: tuple[Person, ...]
    city_land: dict[str, str]
    land_ruler: dict[str, str]
    documents: tuple[Document, ...]


@functools.cache
def world() -> World:
    """The corpus's facts and documents, the same on every machine."""
    rng = np.random.default_rng(SEED)
    used: set[str] = set()

    def names(n: int, syllables: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            name = "".join(rng.choice(_SYLLABLES, size=syllables))
            if name not in used:
                used.add(name)
                out.append(name)
        return out

    lands, rulers = names(LANDS, 2), names(LANDS, 2)
    cities = names(CITIES, 3)
    city_land = {c: lands[int(rng.integers(LANDS))] for c in cities}
    land_ruler = dict(zip(lands, rulers, strict=True))
    people = tuple(Person(n, cities[int(rng.integers(CITIES))], _JOBS[int(rng.integers(len(_JOBS)))])
                   for n in names(PEOPLE, 3))  # fmt: skip
    docs = [Document(p.name, f"{p.name}: {p.name} lives in {p.city} and works as a {p.job}") for p in people]
    docs += [Document(c, f"{c}: {c} is a city in {land}") for c, land in city_land.items()]
    docs += [Document(land, f"{land}: {land} is a land ruled by {r}") for land, r in land_ruler.items()]
    return World(people, city_land, land_ruler, tuple(docs))


def corpus() -> tuple[Document, ...]:
    return world().documents


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Retriever:
    """Okapi BM25 over the corpus (``rank_bm25.BM25Okapi``, its default k1 and b)."""

    def __init__(self, documents: tuple[Document, ...]) -> None:
        from rank_bm25 import BM25Okapi

        self.documents = documents
        self._index = BM25Okapi([words(d.text) for d in documents])

    def search(self, query: str, k: int = TOP_K) -> list[Document]:
        terms = words(query)
        if not terms:
            return []
        scores = self._index.get_scores(terms)
        best = np.argsort(-scores, kind="stable")[:k]
        return [self.documents[i] for i in best if scores[i] > 0]


@functools.cache
def retriever() -> Retriever:
    return Retriever(corpus())


def information(query: str) -> str:
    """What the environment appends after ``<search>query</search>``."""
    return "<information>" + search_text(query) + "</information>" + TURN_END


def normalize(answer: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in answer.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


# The format as a chat (``tokenizer.chat_template = CHAT_TEMPLATE``, ``Renderer(..., turn_end=TURN_END)``,
# the endpoint's ``tags`` tool parser): a user message is the question, an assistant's tool call
# ``search(query)`` is ``<search>query</search>``, a tool message the ``<information>`` after it.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- 'ask:' + m.content + '=' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{{- '<' + c.function.name + '>' + c.function.arguments + '</' + c.function.name + '>' }}"
    "{%- endfor %}{{- '\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<information>' + m.content + '</information>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus of facts (BM25); returns the best matching facts.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def question(problem: Problem) -> str:
    """The question of a problem (its prompt without the ``ask:`` and ``=`` around it)."""
    return problem.prompt.removeprefix("ask:").removesuffix("=")


def search_text(query: str) -> str:
    """What a search for ``query`` finds, as the ``<information>`` shows it (without the tags)."""
    return ", ".join(d.text for d in retriever().search(query)) or NO_RESULTS


_SEARCH = re.compile(r"<search>(.*?)</search>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>")


def last_answer(response: str) -> str | None:
    found = _ANSWER.findall(response)
    return found[-1] if found else None


def _held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % 10 == 0


class SearchQA(Task):
    """Multi-hop questions answered by searching; reward 1 iff the last ``<answer>`` matches."""

    name = "search"
    max_tokens = 640  # the longest reference response, observations included, plus EOS
    turn_end = TURN_END
    max_turns = MAX_TURNS
    max_turn_tokens = 48  # the longest action (a search for a three-syllable name, its newline) is 27

    def draw(self, rng: np.random.Generator) -> Problem:
        w = world()
        person = w.people[int(rng.integers(len(w.people)))]
        hops = int(rng.choice([1, 2, 3], p=[0.4, 0.35, 0.25]))
        land = w.city_land[person.city]
        if hops == 1 and rng.random() < 0.5:
            question, chain, answer = f"what is the job of {person.name}", [person.name], person.job
        elif hops == 1:
            question, chain, answer = f"where does {person.name} live", [person.name], person.city
        elif hops == 2:
            question, chain, answer = f"in which land does {person.name} live", [person.name, person.city], land
        else:
            question, chain, answer = (f"who rules the land where {person.name} lives", [person.name, person.city, land],
                                       w.land_ruler[land])  # fmt: skip
        steps = "".join(f"<search>{q}</search>{TURN_END}{information(q)}" for q in chain)
        return Problem(prompt=f"ask:{question}=", answer=f"{steps}<answer>{answer}</answer>")

    def held_out(self, problem: Problem) -> bool:
        """By person: a held-out person's facts never appear in a training answer."""
        return _held_out(_person(problem))

    def segments(self, problem: Problem) -> list[tuple[str, bool]]:
        """The model's turns are learned; the ``<information>`` the environment returned is not."""
        pieces: list[tuple[str, bool]] = []
        for part in re.split(r"(<information>.*?</information>\n)", problem.answer):
            if part:
                pieces.append((part, not part.startswith("<information>")))
        return pieces

    def respond(self, problem: Problem, response: str) -> str | None:
        """The environment after a turn: the search result for a ``<search>`` turn, else None (done)."""
        turn = response.rsplit("</information>" + TURN_END, 1)[-1]
        found = _SEARCH.findall(turn)
        if not found or _ANSWER.search(turn):
            return None
        return information(found[-1])

    def observation_ok(self, observation: str) -> bool:
        """A search that found nothing is a failed tool call."""
        return NO_RESULTS not in observation

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 iff the response ends with its ``<answer>`` (then EOS) and that answer matches."""
        response = completion.strip()
        got, want = last_answer(response), last_answer(problem.answer)
        if got is None or want is None or not response.endswith("</answer>"):
            return 0.0
        return 1.0 if normalize(got) == normalize(want) else 0.0


def _person(problem: Problem) -> str:
    """The person a question is about (the one word of it that names a person)."""
    names = _people_names()
    return next(w for w in problem.prompt.removeprefix("ask:").removesuffix("=").split() if w in names)


@functools.cache
def _people_names() -> frozenset[str]:
    return frozenset(p.name for p in world().people)

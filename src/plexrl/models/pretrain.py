"""Pretrain plexrl's shipped task model (``tiny-arith``) on synthetic problems to partial competence.

    python -m plexrl.models.pretrain [--out DIR] [--steps N] [--seed S] [--lr LR] [--tasks T,..] [--init DIR]

A Qwen2 decoder with :data:`ARITH_CONFIG` learns the reference completions of a mixture of the
tasks' training problems (cross-entropy on the learned pieces of each completion and EOS only;
see ``Task.segments``). The mixture is :attr:`Recipe.tasks`: any task in ``plexrl.tasks.TASKS``
joins it by name. Tasks are learnt at very different speeds (reversal in a couple of hundred
steps, then near perfectly; addition in about a thousand), so each task's share of the batch is
steered by its validation accuracy into :attr:`Recipe.band`, and training stops when every task
is in it: the model gets some held-out problems right and many wrong, so GRPO has reward to gain
and groups whose rewards differ. Rows of very different lengths (``sum``'s worked solutions run
to hundreds of tokens) are trained in micro-batches of similar length, so padding stays small.
At the end it reports the held-out greedy accuracy and the mean reward of temperature-1 samples
per task (and, for ``sum``, accuracy by the number of terms and the length of its samples),
saves the model (float32 safetensors), tokenizer files and a generation config, and writes
``MODEL_CARD.md`` with those numbers and the exact command.

``--init DIR`` continues from a saved model instead of a fresh one: ``tiny-arith-chat`` is
``tiny-arith`` taught the ``chat`` task (the Tinker cookbook's chat format) the same way.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from plexrl.live import LiveView
from plexrl.models.tiny import TINY_CONFIG
from plexrl.models.tokenizer import ALPHABET, SPECIAL_TOKENS, VOCAB_SIZE, CharTokenizer, write_hf_tokenizer
from plexrl.tasks import EVAL_SIZE, TASKS, Problem, Task

# The shipped model has the tiny test model's shape, so one config (and vocabulary) serves both.
ARITH_CONFIG: dict[str, Any] = dict(TINY_CONFIG)

DEFAULT_OUT = Path(__file__).resolve().parent / "tiny-arith"
SAMPLES_PER_PROBLEM = 4  # temperature-1 samples per held-out problem for the sampled reward
GENERATE_BATCH = 64  # prompts per generate call when evaluating


@dataclass(frozen=True)
class Recipe:
    """How the model is trained; every field goes into the model card."""

    max_steps: int = 2500
    seed: int = 0
    problems_below_band: int = 43  # per step, for each task whose validation accuracy is below the band
    problems_in_band: int = 8  # per step, for each task in the band; a task above it gets none
    lr: float = 1e-3  # peak, after a linear warmup; then cosine decay to lr / 10 at max_steps
    warmup_steps: int = 100
    weight_decay: float = 0.01
    band: tuple[float, float] = (0.25, 0.55)  # the validation greedy accuracy each task is steered into
    check_every: int = 25  # steps between validation checks
    validation_size: int = 100  # per task, drawn from the training side and kept out of training
    tokens_per_micro_batch: int = 4096  # rows x padded length of one forward/backward
    tasks: tuple[str, ...] = ("add", "mul", "rev", "sum", "search")
    init: str | None = None  # a model directory to continue from; None: a fresh model


@dataclass(frozen=True)
class Scores:
    greedy_accuracy: float  # fraction of the held-out set answered exactly, greedy decoding
    sampled_reward: float  # mean reward of temperature-1 samples on the held-out set
    sampled_lengths: list[int] = field(default_factory=list)  # new tokens of each temperature-1 sample
    by_terms: dict[int, tuple[int, float]] = field(default_factory=dict)  # sum: terms -> (problems, greedy accuracy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plexrl.models.pretrain", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--steps", type=int, default=Recipe.max_steps, help="most training steps (it usually stops sooner)"
    )
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument("--tasks", default=",".join(Recipe.tasks), help="the mixture, task names separated by commas")
    parser.add_argument("--init", default=None, help="continue from this model directory (default: a fresh model)")
    args = parser.parse_args(argv)
    tasks = tuple(args.tasks.split(","))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown tasks {unknown}; valid: {', '.join(TASKS)}")
    recipe = Recipe(max_steps=args.steps, seed=args.seed, lr=args.lr, tasks=tasks, init=args.init)

    torch.set_num_threads(2)
    start = time.monotonic()
    model, steps = train(recipe, start)
    train_seconds = time.monotonic() - start
    scores = {name: evaluate(model, TASKS[name], seed=recipe.seed) for name in recipe.tasks}
    for name, s in scores.items():
        print(f"{name}: held-out greedy accuracy {s.greedy_accuracy:.3f}, T=1 mean reward {s.sampled_reward:.3f}")
    save(model, args.out)
    command = " ".join(["python -m plexrl.models.pretrain", *(sys.argv[1:] if argv is None else argv)])
    write_model_card(args.out, model, recipe, steps, scores, train_seconds, command)
    print(f"saved to {args.out} ({time.monotonic() - start:.0f}s in all)")


def train(recipe: Recipe, start: float) -> tuple[Any, int]:
    """A freshly initialised model (or ``recipe.init``'s) trained by ``recipe`` and its step count;
    deterministic given the seed.

    Every ``check_every`` steps each task's validation greedy accuracy sets its problems per step
    until the next check: many below the band, a few in it, none above it (so an overshooting task
    drifts back down while the others train). Training ends at the first check where every task is
    in the band, which leaves each one partially competent rather than solved.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(recipe.seed)
    if recipe.init is None:
        model: Any = Qwen2ForCausalLM(Qwen2Config(**ARITH_CONFIG))
    else:
        model = Qwen2ForCausalLM.from_pretrained(recipe.init, dtype=torch.float32)
    rng = np.random.default_rng(recipe.seed)
    tok = CharTokenizer()
    validation = {name: _validation_set(TASKS[name], recipe) for name in recipe.tasks}
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    counts = {name: recipe.problems_below_band for name in recipe.tasks}
    view = LiveView(["pretrain"], recipe.max_steps, log_every=recipe.check_every)
    for step in range(1, recipe.max_steps + 1):
        model.train()
        rows = [
            _training_row(TASKS[name], p, tok)
            for name, n in counts.items()
            for p in _training_problems(TASKS[name], n, rng, validation[name])
        ]
        loss = _train_step(model, rows, recipe.tokens_per_micro_batch, tok.pad_token_id)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % recipe.check_every and step != recipe.max_steps:
            view.update("pretrain", done=step, loss=loss)  # the check below shows the others
        if step % recipe.check_every == 0 or step == recipe.max_steps:
            model.eval()
            accuracy = {name: greedy_accuracy(model, TASKS[name], validation[name]) for name in recipe.tasks}
            counts = {name: _problems_per_step(a, recipe) for name, a in accuracy.items()}
            shown = " ".join(f"{name} {a:.2f}" for name, a in accuracy.items())
            view.update("pretrain", done=step, loss=loss, validation=shown)
            if all(recipe.band[0] <= a <= recipe.band[1] for a in accuracy.values()):
                return model.eval(), step
            if not any(counts.values()):
                print("every task is above the band; stopping here", flush=True)
                return model.eval(), step
    return model.eval(), recipe.max_steps


def _lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine decay to a tenth: late steps move a nearly steered model gently
    (a constant rate made a task's accuracy swing by tens of points between checks)."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    done = (step - recipe.warmup_steps) / max(1, recipe.max_steps - recipe.warmup_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


def _problems_per_step(accuracy: float, recipe: Recipe) -> int:
    low, high = recipe.band
    if accuracy < low:
        return recipe.problems_below_band
    return recipe.problems_in_band if accuracy <= high else 0


def _validation_set(task: Task, recipe: Recipe) -> list[Problem]:
    """Distinct training-side problems that pretraining never trains on, to decide when to stop."""
    rng = np.random.default_rng(zlib.crc32(f"validation:{task.name}:{recipe.seed}".encode()))
    problems: dict[str, Problem] = {}
    while len(problems) < recipe.validation_size:
        for p in task.sample(recipe.validation_size, rng):
            problems.setdefault(p.prompt, p)
    return list(problems.values())[: recipe.validation_size]


def _training_problems(task: Task, n: int, rng: np.random.Generator, validation: list[Problem]) -> list[Problem]:
    held = {p.prompt for p in validation}
    problems: list[Problem] = []
    while len(problems) < n:
        problems.extend(p for p in task.sample(n - len(problems), rng) if p.prompt not in held)
    return problems


def _training_row(task: Task, problem: Problem, tok: CharTokenizer) -> tuple[list[int], list[bool]]:
    """``[bos] prompt completion [eos]`` and which positions are learned (the learned segments and EOS)."""
    ids = tok.encode(problem.prompt)
    learned = [False] * len(ids)
    for text, learn in task.segments(problem):
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        learned += [learn] * len(piece)
    return [*ids, tok.eos_token_id], [*learned, True]


def _train_step(
    model: Any, rows: list[tuple[list[int], list[bool]]], tokens_per_micro_batch: int, pad_id: int
) -> float:
    """Accumulate the gradient of the mean cross-entropy over every learned token of ``rows``.

    Rows go in order of length into micro-batches of at most ``tokens_per_micro_batch`` padded
    tokens, so a step of mostly short rows and a few long ones pads little.
    """
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    learned_total = sum(sum(learned[1:]) for _, learned in rows)
    total, batch = 0.0, []
    for n, i in enumerate(order):
        batch.append(rows[i])
        longest = len(batch[-1][0])
        following = len(rows[order[n + 1]][0]) if n + 1 < len(order) else 0
        if n + 1 < len(order) and (len(batch) + 1) * following <= tokens_per_micro_batch:
            continue
        input_ids_B_T, labels_B_T, attention_B_T = _right_padded(batch, longest, pad_id)
        logits_B_T_V = model(input_ids=input_ids_B_T, attention_mask=attention_B_T).logits
        loss = F.cross_entropy(
            logits_B_T_V[:, :-1].flatten(0, 1), labels_B_T[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / learned_total).backward()
        total += loss.item()
        batch = []
    return total / learned_total


def _right_padded(rows: list[tuple[list[int], list[bool]]], T: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    input_ids_B_T = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels_B_T = torch.full((len(rows), T), -100, dtype=torch.long)
    attention_B_T = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (ids, learned) in enumerate(rows):
        row = torch.tensor(ids)
        input_ids_B_T[i, : len(ids)] = row
        labels_B_T[i, : len(ids)] = torch.where(torch.tensor(learned), row, -100)
        attention_B_T[i, : len(ids)] = 1
    return input_ids_B_T, labels_B_T, attention_B_T


@torch.no_grad()
def complete(
    model: Any,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: list[int],
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """One completion per prompt (token ids; greedy when ``temperature`` is 0) of at most
    ``max_new_tokens[i]`` tokens: its new tokens up to EOS (or a ``stop_ids`` token), included.

    transformers ``generate`` with a KV cache on left-padded prompts, batched by budget (a batch
    decodes for its largest budget, and rows are cut to their own); sampling is deterministic
    given ``seed`` (and leaves the caller's global RNG alone).
    """
    from transformers import GenerationConfig

    tok = CharTokenizer()
    stops = {tok.eos_token_id, *stop_ids}
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    order = sorted(range(len(prompts)), key=lambda i: (max_new_tokens[i], len(prompts[i])))
    completions: list[list[int]] = [[] for _ in prompts]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(order), GENERATE_BATCH):
            chunk = order[start : start + GENERATE_BATCH]
            config = GenerationConfig(
                max_new_tokens=max(max_new_tokens[i] for i in chunk),
                do_sample=temperature > 0,
                eos_token_id=sorted(stops),
                pad_token_id=tok.pad_token_id,
                **sampling,
            )
            encoded = [prompts[i] for i in chunk]
            T = max(len(e) for e in encoded)
            ids_B_T = torch.tensor([[tok.pad_token_id] * (T - len(e)) + e for e in encoded])
            attention_B_T = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in encoded])
            out = model.generate(input_ids=ids_B_T, attention_mask=attention_B_T, generation_config=config)
            for i, row in zip(chunk, out[:, T:].tolist(), strict=True):
                row = row[: max_new_tokens[i]]
                end = next((k for k, t in enumerate(row) if t in stops), None)
                completions[i] = row if end is None else row[: end + 1]
    return completions


def respond_all(
    model: Any, task: Task, problems: list[Problem], temperature: float, budgets: list[int], seed: int = 0
) -> list[list[int]]:
    """Each problem's response: for a multi-turn task the model's turns with the environment's
    observations (``task.respond``) between them, up to ``task.max_turns`` turns and ``budgets[i]``
    tokens in all; for any other task one completion."""
    tok = CharTokenizer()
    contexts = [tok.encode(p.prompt) for p in problems]
    if task.turn_end is None:
        return complete(model, contexts, temperature, budgets, seed)
    (turn_end,) = tok.encode(task.turn_end, add_special_tokens=False)
    responses: list[list[int]] = [[] for _ in problems]
    active = list(range(len(problems)))
    for turn in range(task.max_turns):
        left = [min(budgets[i] - len(responses[i]), task.max_turn_tokens or budgets[i]) for i in active]
        outs = complete(model, [contexts[i] for i in active], temperature, left, seed + turn, (turn_end,))
        going = []
        for i, out in zip(active, outs, strict=True):
            responses[i] += out
            if out and out[-1] == turn_end and len(responses[i]) < budgets[i]:
                observation = task.respond(problems[i], tok.decode(responses[i], skip_special_tokens=True))
                if observation is not None:
                    ids = tok.encode(observation, add_special_tokens=False)[: budgets[i] - len(responses[i])]
                    responses[i] += ids
                    contexts[i] = contexts[i] + out + ids
                    going.append(i)
        active = [i for i in going if len(responses[i]) < budgets[i]]
        if not active:
            break
    return responses


def greedy_accuracy(model: Any, task: Task, problems: list[Problem]) -> float:
    """Greedy accuracy, each answer given the reference's length and a few tokens to spare (a
    longer one is not the worked solution): cheap enough to check long tasks often."""
    tok = CharTokenizer()
    budgets = [min(task.max_tokens, len(tok.encode(p.answer, add_special_tokens=False)) + 4) for p in problems]
    completions = respond_all(model, task, problems, 0.0, budgets)
    return float(np.mean(_scores(task, problems, completions)))


def _scores(task: Task, problems: list[Problem], completions: list[list[int]]) -> list[float]:
    tok = CharTokenizer()
    return [task.score(p, tok.decode(c, skip_special_tokens=True)) for p, c in zip(problems, completions, strict=True)]


def evaluate(model: Any, task: Task, seed: int) -> Scores:
    """Greedy accuracy and mean temperature-1 reward of ``model`` on ``task``'s held-out set."""
    problems = task.eval_set()
    repeated = problems * SAMPLES_PER_PROBLEM
    sampled = respond_all(model, task, repeated, 1.0, [task.max_tokens] * len(repeated), seed=seed)
    greedy = respond_all(model, task, problems, 0.0, [task.max_tokens] * len(problems))
    right = _scores(task, problems, greedy)
    by_terms: dict[int, list[float]] = {}
    if task.name == "sum":
        for p, r in zip(problems, right, strict=True):
            by_terms.setdefault(p.prompt.count("+") + 1, []).append(r)
    return Scores(
        greedy_accuracy=float(np.mean(right)),
        sampled_reward=float(np.mean(_scores(task, repeated, sampled))),
        sampled_lengths=[len(c) for c in sampled],
        by_terms={k: (len(v), float(np.mean(v))) for k, v in sorted(by_terms.items())},
    )


def save(model: Any, out: Path) -> None:
    """Model weights (float32 safetensors), config, generation config and tokenizer files."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = CharTokenizer()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=max(task.max_tokens for task in TASKS.values()),
    )
    model.save_pretrained(out, safe_serialization=True)
    write_hf_tokenizer(out, tok)


def write_model_card(
    out: Path, model: Any, recipe: Recipe, steps: int, scores: dict[str, Scores], train_seconds: float, command: str
) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    weights_mb = (out / "model.safetensors").stat().st_size / 1e6
    config = ", ".join(f"{k}={v}" for k, v in ARITH_CONFIG.items())
    tasks = ", ".join(f"`{name}`" for name in recipe.tasks)
    examples = "\n".join(
        f"- `{name}`: `{_shown(TASKS[name].eval_set()[0].prompt)}` -> `{_shown(TASKS[name].eval_set()[0].answer)}`"
        for name in recipe.tasks
    )
    table = "\n".join(
        f"| {name} | {s.greedy_accuracy:.3f} | {s.sampled_reward:.3f} | {_percentiles(s.sampled_lengths)} |"
        for name, s in scores.items()
    )
    terms = "\n".join(
        f"| {label} | {sum(n for n, _ in rows)} | {sum(n * a for n, a in rows) / sum(n for n, _ in rows):.3f} |"
        for label, rows in _term_buckets(scores).items()
    )
    start = "from scratch" if recipe.init is None else f"from `{Path(recipe.init).name}`"
    card = f"""# {out.name}

A plexrl shipped task model: a small Qwen2 decoder pretrained {start} by
`plexrl.models.pretrain` on synthetic problems of the tasks in `plexrl.tasks` ({tasks}),
deliberately only to *partial* competence so that RL (GRPO) has held-out reward to gain.

## Model

- Architecture: `Qwen2ForCausalLM`; {config}
- Parameters: {num_params:,} ({weights_mb:.1f} MB of float32 safetensors)
- Tokenizer: `plexrl.models.CharTokenizer`, one id per character (pad=0, bos=1, eos=2,
  ids {len(SPECIAL_TOKENS) + len(ALPHABET)}-{VOCAB_SIZE - 1} unused), also saved as `tokenizer.json` for `transformers.AutoTokenizer`.
- Format: the model reads `[bos] + encode(prompt)` and writes the answer's characters, then EOS:

{examples}

## How it was made

- Data: fresh training problems from `Task.sample` (never the held-out side of the split), drawn
  anew every step; each task's share of the batch is steered by its accuracy (below).
- Mixture and stopping: every {recipe.check_every} steps, greedy accuracy on {recipe.validation_size} validation problems
  per task (training-side problems kept out of training). Until the next check a task gets
  {recipe.problems_below_band} problems per step while below {recipe.band[0]:g}, {recipe.problems_in_band} while in [{recipe.band[0]:g}, {recipe.band[1]:g}], and none above.
  Training ends at the first check where every task is in that band, or where every task is above it. (Reversal is learnt several
  times faster than addition and, once learnt, is near perfect; without steering it would be
  solved long before addition started.)
- Loss: cross-entropy on the answer tokens and EOS only.
- Optimiser: AdamW, peak lr {recipe.lr:g} after {recipe.warmup_steps} linear warmup steps, cosine decay to a tenth at step {recipe.max_steps}, weight decay {recipe.weight_decay:g},
  gradient norm clipped at 1.0; seed {recipe.seed}.
- Steps: {steps} (cap {recipe.max_steps}).
- Time: {train_seconds:.0f} s of training (checks included) on 2 CPU threads, torch {torch.__version__}.
- Command (from the repository root, with `src` on the path): `{command}`

## Baseline held-out scores

On each task's `eval_set()` ({EVAL_SIZE} problems, disjoint from all training problems): greedy
accuracy, and the mean reward of temperature-1 samples ({SAMPLES_PER_PROBLEM} per problem, up to the task's `max_tokens` new
tokens, no top-k/top-p), which is what RL starts from.

| task | greedy accuracy | T=1 mean reward | T=1 sample length, tokens: p50 / p90 / p99 / max |
|---|---|---|---|
{table}

`sum`'s worked solutions make its sample lengths heavy-tailed, and its accuracy falls with the
number of terms (each addition is another chance to slip). Greedy accuracy by terms:

| terms | problems | greedy accuracy |
|---|---|---|
{terms}

## Notes for RL

The competence is shallow and easily moved: during pretraining a task's validation accuracy often
swung by tens of points within {recipe.check_every} steps once its share of the batch changed (reversal
most of all). Expect RL to raise reward quickly, especially on `rev`, and prefer small learning rates
when a run should show a gradual curve.
"""
    (out / "MODEL_CARD.md").write_text(card)


def _shown(text: str) -> str:
    """``text`` on one line of the card (a chat prompt's newlines as ``\\n``)."""
    return text.replace("\n", "\\n")


def _percentiles(lengths: list[int]) -> str:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return f"{p50:.0f} / {p90:.0f} / {p99:.0f} / {max(lengths)}"


def _term_buckets(scores: dict[str, Scores]) -> dict[str, list[tuple[int, float]]]:
    """``sum``'s accuracy by terms, in buckets 2, 3, 4, 5-7, 8-15, 16+."""
    buckets: dict[str, list[tuple[int, float]]] = {}
    by_terms = scores["sum"].by_terms if "sum" in scores else {}
    for k, row in by_terms.items():
        label = next(name for name, lo in (("16+", 16), ("8-15", 8), ("5-7", 5), (str(k), 0)) if k >= lo)
        buckets.setdefault(label, []).append(row)
    return buckets


if __name__ == "__main__":
    main()

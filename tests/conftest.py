"""Shared fixtures: the shared-memory leak check on every test, and running the command line."""

import multiprocessing.process
import os
import subprocess
import sys
import time

import pytest
import torch

torch.set_num_threads(1)

_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def run_cli():
    """``run_cli(*args)``: ``posttrain ARGS`` in a fresh process, as a user runs it; returns the
    completed process (stdout, stderr, returncode)."""

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True,
                              timeout=timeout, env=_ENV)

    return run


@pytest.fixture
def cli(capsys):
    """``cli(*args)``: ``posttrain ARGS`` in this process (quicker than :func:`run_cli` where a
    fresh interpreter is not the point); returns ``(exit code, stdout, stderr)``."""
    from posttrain.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:  # a usage error, reported by argparse
            rc = e.code
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    return run


@pytest.fixture
def cli_proc(cli):
    """``cli_proc(*args)``: ``posttrain ARGS`` in this process, answered like :func:`run_cli` (a
    completed process with ``returncode``, ``stdout``, ``stderr``): for commands whose output the
    test reads and for which a fresh interpreter is not the point (it costs 3-4 s of imports).
    Only what this process prints is captured: lines a rank process prints (a trainer's step
    lines) are not, so a test that reads those takes :func:`run_cli`."""

    def run(*args: str) -> subprocess.CompletedProcess:
        rc, out, err = cli(*args)
        return subprocess.CompletedProcess(["posttrain", *args], rc, out, err)

    return run


#: The fast tier: single-process tests of pure functions (schedules, balancing, simulation, data,
#: layout), under a minute in all. Every other module, and a test marked ``full`` in these, is the
#: full tier (multi-process parity, command-line runs, benchmarks). ``make test`` runs both.
FAST_MODULES = {"test_balance", "test_data", "test_data_formats", "test_device", "test_layout", "test_packed_attention",
                "test_packing", "test_pipeline_schedules", "test_sim"}


def pytest_collection_modifyitems(config, items):
    import torch

    # The slowest tests first (a stable sort): `make test`'s workers take tests in collection
    # order, and one that starts last keeps the run going while the other worker idles.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in FAST_MODULES:
            item.add_marker(pytest.mark.full)
        if item.get_closest_marker("cuda"):  # the full tier (a GPU test may start ranks wherever it lives)
            item.add_marker(pytest.mark.full)
            if not torch.cuda.device_count():  # (NVML: keeps pytest fork-safe)
                item.add_marker(no_cuda)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """Keep ``--dist loadgroup`` grouping on pytest 9.2: pytest-xdist 3.8 marks a grouped test by
    appending ``@group`` to the item's legacy ``_nodeid``, which pytest 9.2's structured node ids
    no longer read, so every ``xdist_group`` was silently spread over the workers (each building
    the group's module fixture again; pytest-xdist issue 1386). On a worker, before xdist sends
    the collected ids to the scheduler, give each grouped item's id the suffix where xdist's did
    not take."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not session.config.getvalue("loadgroup"):
        return
    for item in session.items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """A fast-tier test that starts a process (a rank, a command) fails: mark it ``full``."""
    if request.node.get_closest_marker("full"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is in the fast tier but starts a process: mark it full")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def _ours() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("posttrain")}


@pytest.fixture(autouse=True)
def _no_shm_leak():
    """Every test must leave nothing of ours in /dev/shm.

    A name exists only between creation and the moment every rank mapped it, so a file that is
    still there after a grace period is a leak; one that vanishes belonged to another job
    running concurrently on this machine (another test worker's: under load its ranks may take
    seconds to map a name, so the grace is long; it costs time only while such a name exists).
    """
    before = _ours()
    yield
    leaked = _ours() - before
    deadline = time.monotonic() + 10.0
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked &= _ours()
    assert not leaked, f"leaked in /dev/shm: {sorted(leaked)}"


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with a ChatML template, trained on the embedded chat task's text."""
    from posttrain.data.tasks import train_chat_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_chat_tokenizer().save_pretrained(path)
    return str(path)


#: Tiny ``transformers`` configs per family (random weights; nothing downloaded).
FAMILIES = ("llama", "qwen2", "mistral")


def make_tiny_model(family: str, path, tokenizer_dir: str, *, seed: int = 0, layers: int = 2) -> str:
    """A random ``family`` causal LM saved with ``save_pretrained`` into ``path``, with the tokenizer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = {"llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
              "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
              "mistral": lambda: transformers.MistralConfig(**common, tie_word_embeddings=False,
                                                            sliding_window=None)}[family]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, chat_tokenizer_dir):
    """``tiny_model(family)``: the directory of a tiny random model of that family (made once)."""
    made = {}

    def get(family: str = "llama") -> str:
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(family), chat_tokenizer_dir)
        return made[family]

    return get

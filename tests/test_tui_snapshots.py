"""What the app looks like at 100×30, as SVG snapshots (tests/__snapshots__/). Ages are computed from a fixed
clock, timings and compressed sizes are drawn as "…", and the cursor does not blink, so the pictures are stable;
`pytest --snapshot-update` rewrites them after an intended change."""

from __future__ import annotations

import pytest

from screen_text import labels_cut
from tui_support import fixed_clock, make_app, screen, seed_chat, wait_for, wait_idle

SIZE = (100, 30)
REPLY = "Noted, **Ada**:\n\n- you live in *Lisbon*\n- your dog is `Rex`"


def frozen_app():
    return make_app(clock=fixed_clock("2025-01-15T12:00:00+00:00"), show_measurements=False)


def seed_two_chats() -> tuple[str, str]:
    older = seed_chat("Trip planning", [("I go to Porto in May.", "Noted: Porto in May.")], with_kv=False,
                      updated="2025-01-12T09:00:00+00:00")
    newer = seed_chat("About me", [("My name is Ada.", "Nice to meet you, Ada."),
                                   ("I live in Lisbon and my dog is Rex.", REPLY)], with_kv=False,
                      system_prompt="You remember facts.", updated="2025-01-15T11:55:00+00:00")
    return older, newer


async def ready(pilot) -> None:
    await wait_for(pilot, lambda: "cpu" in str(screen(pilot.app).status_bar.render()), what="the model")
    await wait_for(pilot, lambda: screen(pilot.app)._chats_shown, what="the chat list")
    await wait_idle(pilot)


def test_main_screen_with_chats_and_none_open(snap_compare):
    seed_two_chats()
    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=ready)


def test_open_chat_renders_markdown_and_the_status_bar(snap_compare):
    seed_two_chats()

    async def open_newest(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+f", "enter", "enter")
        await wait_idle(pilot)
        screen(pilot.app).app.backend.drain()  # the recomputed rounds' K/V written: nothing changes after

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=open_newest)


def test_help_screen(snap_compare):
    assert snap_compare(frozen_app(), terminal_size=SIZE, press=["f1"], run_before=ready)


def test_delete_asks_first(snap_compare):
    seed_two_chats()

    async def ask(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+f", "enter", "f8")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=ask)


def test_settings_dialog(snap_compare):
    assert snap_compare(frozen_app(), terminal_size=SIZE, press=["f9"], run_before=ready)


# The smallest terminal the app is made for and a large one: nothing cut mid-word at either (issue 42).
SIZES = {"80x24": (80, 24), "160x45": (160, 45)}
CODE_REPLY = "Like this:\n\n```python\nprint('Rex')\n```"


@pytest.mark.parametrize("size", SIZES)
def test_open_chat_at_size(snap_compare, size):
    seed_two_chats()
    seed_chat("My niece is called Lena and she is four years…", [("How do I print my dog's name?", CODE_REPLY)],
              with_kv=False, updated="2025-01-15T11:58:00+00:00")
    cut = {}

    async def open_newest(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+f", "enter", "enter")
        await wait_idle(pilot)
        screen(pilot.app).app.backend.drain()
        cut.update(labels_cut(pilot.app))

    assert snap_compare(frozen_app(), terminal_size=SIZES[size], run_before=open_newest)
    assert cut == {}


@pytest.mark.parametrize("size", SIZES)
def test_settings_dialog_at_size(snap_compare, size):
    cut = {}

    async def settings(pilot) -> None:
        await ready(pilot)
        await pilot.press("f9")
        await wait_idle(pilot)
        cut.update(labels_cut(pilot.app))

    assert snap_compare(frozen_app(), terminal_size=SIZES[size], run_before=settings)
    assert cut == {}


"""The commands' rough edges a first session meets (issue 42): the README's first examples print what they promise,
`generate` on the demo model says why it wrote nothing, `bench --help` names every method, an untitled chat's
title ends at a word, and importing a file twice gives two titles."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cli_run import kvchat

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_s_first_chat_example_prints_what_it_promises():
    use = README.read_text().split("## Use", 1)[1]
    first_block = re.findall(r"(?:^    .*\n)+", use, flags=re.M)[0]
    sends = re.findall(r'kvchat send \$S "([^"]+)"\s+# (.+)', first_block)
    assert len(sends) >= 2, "the first example is a chat: messages and the replies they print"
    sid = kvchat("new").stdout.strip()
    for message, promised in sends:
        assert kvchat("send", sid, message).stdout.strip() == promised.strip(), message


def test_generate_on_the_demo_model_says_why_it_wrote_nothing():
    # A raw prompt, no chat template: the demo model ends it at once. Not a bare empty line: a notice that says why.
    out = kvchat("generate", "--max-tokens", "16", "My name is Ada.")
    assert out.stdout == ""
    assert "wrote nothing" in out.stderr and "kvchat send" in out.stderr
    # In its chat template it answers (the README says so: "generate is for real models").
    prompt = "<|im_start|>user\nMy name is Ada.<|im_end|>\n<|im_start|>assistant\n"
    answered = kvchat("generate", "--max-tokens", "16", prompt)
    assert "Ada" in answered.stdout and "wrote nothing" not in answered.stderr


def test_bench_help_names_every_method():
    from kvchat.app.bench.resume import default_methods, method_names

    text = kvchat("bench", "--help").stdout
    methods_help = text.split("--methods", 1)[1].split("--repeats", 1)[0]
    for method in method_names():  # kv-split and kv-merge among them, never split at a hyphen
        assert re.search(rf"(?<![\w:+-]){re.escape(method)}(?![\w+-])", methods_help), method
    assert "kv-split" in method_names() and "kv-merge" in method_names()
    default = " ".join(methods_help.split("Default:", 1)[1].split())
    assert default.rstrip(".") == ", ".join(default_methods())


def test_an_untitled_chat_s_title_ends_at_a_word():
    from kvchat.app.session.service import auto_title

    assert auto_title("  What  is\nmy name? ") == "What is my name?"
    assert auto_title("My niece is called Lena and she is four years old and lives in Porto.") == \
        "My niece is called Lena and she is four years…"
    assert auto_title("x" * 60) == "x" * 47 + "…"  # one long word: cut, but marked
    for n in range(40, 60):
        title = auto_title("word " * 30, limit=n)
        assert len(title) <= n and title.endswith("word…")
    sid = kvchat("new").stdout.strip()
    message = "My niece is called Lena and she is four years old and lives in Porto."
    kvchat("send", sid, message)
    title = json.loads(kvchat("sessions", "--json").stdout)[0]["title"]
    assert title.endswith("…") and message.startswith(title[:-1]) and message[len(title) - 1] == " "


def test_importing_a_file_twice_gives_the_second_chat_a_title_of_its_own(tmp_path):
    sid = kvchat("new", "--title", "Trip").stdout.strip()
    kvchat("send", sid, "I go to Porto in May.")
    state = tmp_path / "trip.kvstate"
    kvchat("export", sid, "-o", str(state))
    first = kvchat("import", str(state))
    second = kvchat("import", str(state))
    third = kvchat("import", str(state))
    assert "exists already" in first.stderr and "“Trip (2)”" in first.stderr
    titles = {c["id"]: c["title"] for c in json.loads(kvchat("sessions", "--json").stdout)}
    assert titles[first.stdout.strip()] == "Trip (2)"
    assert titles[second.stdout.strip()] == "Trip (3)"
    assert titles[third.stdout.strip()] == "Trip (4)"
    assert titles[sid] == "Trip"

"""`kvchat eval --kv-policy loopserve` with the policy's options set (the CLI takes none): recall on the embedded
model's held-out chats for one variant, as JSON (the variant's name and options included).

    .venv/bin/python docs/probes/loopserve_eval.py VARIANT [OPTION=VALUE ...] [--chats N] > OUT.json
    # e.g. decode-only sparse=0; decode-only-paper sparse=0 question_rows=0
"""
import json
import sys

from kvchat.assets import DEFAULT_MODEL
from kvchat.engine.engine import Engine
from kvchat.engine.evaluate import evaluate, heldout_chats
from kvchat.engine.policies import make_policy

args = sys.argv[1:]
chats = 40
if "--chats" in args:
    at = args.index("--chats")
    chats = int(args[at + 1])
    del args[at : at + 2]
variant, options = args[0], {}
for item in args[1:]:
    key, value = item.split("=", 1)
    options[key] = int(value) if value.lstrip("-").isdigit() else float(value)
for flag in ("sparse", "progressive"):
    if flag in options:
        options[flag] = bool(options[flag])
engine = Engine(DEFAULT_MODEL, device="cpu")
policy = make_policy("loopserve", engine, **options)
result = evaluate(engine, policy, heldout_chats(chats, 0, 44, 52, engine, 2000, "heldout"))
print(json.dumps(result.as_dict() | {"variant": variant, "options": options}))

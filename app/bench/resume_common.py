"""What the parent and every child process of `kvchat bench` (app/bench/resume.py) share: the reply lengths, the
workload file the setup child writes and the method children read, and how a method's runs become its figures.

Apart from resume.py so that the children (resume_engine.py, resume_llama.py) and the tables need not import the
parent, which imports them to run them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

LLAMA_CPP = "llama.cpp"  # the method name of llama.cpp's state file
REPLY_TOKENS = 32  # greedy tokens of each timed answer
RECALL_TOKENS = 48  # at most, of each recall answer (memory chats)


def load_workload(path: str):
    """A workload file the setup child wrote, its chat and recall questions as chat_format objects again."""
    from kvchat.engine.text.chat_format import Conversation, Round

    d = json.loads(Path(path).read_text())
    d["conversation"] = Conversation([Round(u, a) for u, a in d["rounds"]], d["system"])
    d["recall"] = [Round(u, a) for u, a in d["recall"]]
    return d


def evict_files(paths: list[Path]) -> bool:
    """Push the chat's files out of the OS page cache, so the next read comes from the disk: the cold run. False
    where they stay (no such call, or a memory file system, whose pages are the files)."""
    from kvchat.storage.pagecache import evict

    return evict(paths) and not left_resident(paths)


def left_resident(paths: list[Path]) -> list[str]:
    """The files that still have pages in the page cache (sampled): why a cold run was not. An empty file has none
    (mincore counts it whole: an empty SQLite `-wal` would be listed)."""
    from kvchat.storage.pagecache import resident_fraction

    return [p.name for p in paths if p.exists() and p.stat().st_size > 0 and resident_fraction(p) > 0]


def recall_ok(got: str, expected: str) -> bool:
    """Whether an answer to a recall question holds the stated value, judged as `kvchat eval` judges it."""
    from kvchat.app.bench.evaluate import reply_matches

    return reply_matches(got, expected)


def summarize(runs: list[dict], wl: dict, device) -> dict:
    """A method's figures from its runs: the first is the cold one, the median of the rest the warm one."""
    warm = runs[1:] or runs
    return {"status": "ok", "device": device.type, "context": wl["tokens"], "reply_tokens": runs[0]["tokens"],
            "reply_text": runs[0]["text"], "runs_agree": all(r["tokens"] == runs[0]["tokens"] for r in runs),
            "ttft_cold_s": runs[0]["ttft_s"], "ttft_warm_s": statistics.median(r["ttft_s"] for r in warm),
            "ttft_runs_s": [r["ttft_s"] for r in runs], "resume_warm_s": statistics.median(r["resume_s"] for r in warm),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in warm),
            # between the first token and the decode (capturing its graphs), in neither figure above
            **({"decode_setup_warm_s": statistics.median(r["decode_setup_s"] for r in warm)}
               if "decode_setup_s" in runs[0] else {}),
            "cold_files_evicted": bool(runs[0]["page_cache_dropped"]),
            **({"cold_files_left_resident": runs[0]["left_resident"]} if runs[0].get("left_resident") else {})}

"""`kvchat eval` with louiskv's centroids kept in 8 bits as a chat stores them since 2026-11-29, or in bfloat16 as
before (louiskv_fidelity.centroids_in_bf16): whether halving the units' bytes a lazy resume reads before its first
token costs the choice recall (issue 44). Run from this folder:

    python eval_centroids_fp8.py fp8|bf16 eval --kv-policy louiskv --option tokens=1024 --mode app --chats 20 \
        --seed 2 --device cpu --json out.json
"""

from __future__ import annotations

import sys

from louiskv_fidelity import keep_centroids_in_bf16  # this folder's: the probes run as scripts from it

from kvchat.app.cli import main

if __name__ == "__main__":
    if sys.argv[1] not in ("fp8", "bf16"):
        sys.exit("the first argument is fp8 or bf16")
    if sys.argv[1] == "bf16":
        keep_centroids_in_bf16()
    sys.argv = ["kvchat", *sys.argv[2:]]
    main()

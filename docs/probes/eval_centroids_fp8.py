"""`kvchat eval` with louiskv's centroids kept as 8-bit storage would keep them (louiskv_fidelity.centroids_in_fp8),
or as they are: whether halving the units' bytes a lazy resume reads before its first token costs the choice recall
(issue 44). Run from this folder:

    python eval_centroids_fp8.py fp8|bf16 eval --kv-policy louiskv --option tokens=1024 --mode app --chats 20 \
        --seed 2 --device cpu --json out.json
"""

from __future__ import annotations

import sys

from louiskv_fidelity import keep_centroids_in_fp8  # this folder's: the probes run as scripts from it

from kvchat.app.cli import main

if __name__ == "__main__":
    if sys.argv[1] not in ("fp8", "bf16"):
        sys.exit("the first argument is fp8 or bf16")
    if sys.argv[1] == "fp8":
        keep_centroids_in_fp8()
    sys.argv = ["kvchat", *sys.argv[2:]]
    main()

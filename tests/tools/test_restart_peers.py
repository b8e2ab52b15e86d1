"""tools/restart_peers: Ember's rows of `bench restart` against llama.cpp's start (in the test process)."""

from __future__ import annotations

from tools.restart_peers import against_llamacpp

TABLE = """start      time to ready (s)  of which healthy (s)  first token (s)
cold                    2.11                  2.07             0.04
warm 1st                0.28                  0.18             0.10
warm                    0.17                  0.13             0.05
snapshot                0.44                     -                -   (mapped mode, image 302 MiB)
"""


def test_each_start_is_read_from_its_own_row() -> None:
    """'warm 1st' is not the warm row (its '1' was once read as the warm seconds)."""
    assert against_llamacpp(TABLE, 2.0) == [
        "Ember's cold start to a first token: 2.11 s, 1.05x llama.cpp's",
        "Ember's warm start to a first token: 0.17 s, 0.09x llama.cpp's",
        "Ember's snapshot start to a first token: 0.44 s, 0.22x llama.cpp's",
    ]
    assert against_llamacpp(TABLE.replace("snapshot", "other"), 2.0)[-1].startswith("Ember's warm")

"""The snapshot canary: one fixed request whose answer must survive a checkpoint and restore.

Imported by the parked server (`ember serve --snapshot-park`), which answers it before the dump, and by
the `ember snapshot` controller, which asks it again over HTTP after each restore. Kept free of heavy
imports: `ember snapshot restore` is timed from its own start. Greedy, one token, seed 0, logprobs.
"""

from __future__ import annotations

from typing import Any

CANARY_PROMPT = "The quick brown fox"


def canary_request(prompt: str = CANARY_PROMPT) -> dict[str, Any]:
    """The /v1/completions body: greedy, one token, seed 0, the chosen token's id and logprob."""
    return {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }


def canary_result(body: dict[str, Any]) -> dict[str, Any]:
    """Token id, text and logprob of a canary completion's one token."""
    choice = body["choices"][0]
    token = choice["logprobs"]["tokens"][0]
    return {
        "token_id": int(token.removeprefix("token_id:")),
        "text": choice["text"],
        "logprob": choice["logprobs"]["token_logprobs"][0],
    }

"""A third-party logits processor for the tests, installed through its entry point.

`ember_test_plugin-0.1.dist-info` next to this file declares it in the `ember.logits_processors`
group, so an engine whose `sys.path` includes this folder loads it without any flag.
"""

from __future__ import annotations

from typing import Any

from coreproc.base.protocol import SamplingParams
from coreproc.logits_processors import LogitsProcessor, Row


class ForceToken(LogitsProcessor):
    """`{"force_token": {"token": T, "after": K}}`: from output position K on, only T can be chosen."""

    name = "force_token"

    def validate_params(self, params: SamplingParams) -> None:
        args = self.args(params)
        if args is None:
            return
        if not isinstance(args, dict) or not isinstance(args.get("token"), int):
            raise ValueError('expected {"token": <id>, "after": <n>}')
        if not 0 <= args["token"] < self.ctx.vocab_size:
            raise ValueError(f"token must be in [0, {self.ctx.vocab_size})")
        if not isinstance(args.get("after", 0), int) or args.get("after", 0) < 0:
            raise ValueError("after must be a non-negative integer")

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        for row in rows:
            args = self.args(row.params)
            if len(row.output_ids) >= args.get("after", 0):
                token = args["token"]
                kept = logits[row.index, token].clone()
                logits[row.index] = float("-inf")
                logits[row.index, token] = kept
        return logits

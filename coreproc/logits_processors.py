"""The logits-processor plugin interface at its public path (`from coreproc.logits_processors import
LogitsProcessor`); it lives in the shared base, `coreproc.base.logits_processors`."""

from coreproc.base.logits_processors import LogitsProcessor, ProcessorContext, Row

__all__ = ["LogitsProcessor", "ProcessorContext", "Row"]

"""Constrained decoding: request specs -> xgrammar grammars, compiled off the step loop, and the
per-sample matchers whose token bitmasks mask the logits of constrained rows (docs/structured-outputs.md)."""

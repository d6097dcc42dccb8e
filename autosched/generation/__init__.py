"""Text generation: a decoder over TVM's paged KV cache (:mod:`.decoder`), its build into an artifact
(:mod:`.build`) and the runtime that generates from one (:mod:`.generator`)."""

from .generator import Completion, GenerationError, Generator, Sampling

__all__ = ["Completion", "GenerationError", "Generator", "Sampling"]

"""Text generation: a decoder over TVM's paged KV cache (:mod:`.decoder`), its build into an artifact
(:mod:`.build`) and the runtime that generates from one (:mod:`.generator`)."""

import tvm_ffi  # noqa: F401 - imported by barrier.register() below in any case: importing the package brings it

from . import barrier
from .generator import Completion, GenerationError, Generator, Sampling
from .grammar import GrammarError, GrammarSpec

barrier.register()  # before any generation module's VM is made: its decode functions call the barrier

__all__ = ["Completion", "GenerationError", "Generator", "GrammarError", "GrammarSpec", "Sampling"]

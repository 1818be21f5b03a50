"""speculate() for the GPU engines: speculative rounds whose tree is verified with the engine's own decode
arithmetic, so the output equals plain decoding's token for token. The engine says which verifier it has
(verifier()): node by node through its decode step (lucegen.spec_decode.device.NodeVerifier, the default), or the
whole tree in one forward (LayeredEngine: lucegen.engine.layered_verify.TreeVerifier)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .base import ContextOverflow
from .sampling import Sampler


class Speculating:
    """Mixed into an engine with .state (DeviceState), .position, .max_context and decode(token). With
    `speculation` set (lucegen.spec_decode.decode.Speculation), generate() runs speculate() rounds."""
    speculation = None
    max_tree_nodes: int | None = None  # a verifier taking trees of at most this many nodes, a K/V row each (None: any)
    _verifier = None

    def speculate(self, context_ids: Sequence[int], max_new: int, sampler: Sampler) -> list[int]:
        """One speculative round after context_ids (whose last token is not in the state yet): 1 to max_new new
        tokens, the accepted draft tokens then the target's bonus token."""
        n = self.speculation.tokens_per_round(max_new)
        if self.position + n > self.max_context:
            raise ContextOverflow(f"{self.position} tokens in the state + {n} new ones exceed the context of "
                                  f"{self.max_context} tokens")
        if self._verifier is None:
            self._verifier = self.verifier()
        speculation = self.speculation
        room = self.max_context - self.position - 1  # nodes below the root whose K/V rows fit the context
        if self.max_tree_nodes is not None and speculation.budget > room:  # a verifier with a row per node
            speculation = replace(speculation, budget=room)
        return speculation.round(self._verifier, context_ids, max_new, sampler)

    def verifier(self):
        """A new Verifier (lucegen.spec_decode.decode) of this engine's sequence: node by node through decode()."""
        from ..spec_decode.device import NodeVerifier  # here: spec_decode imports the engine's sampler
        return NodeVerifier(self)

    def free_speculation(self) -> None:
        if self._verifier is not None:
            self._verifier.free()
            self._verifier = None

"""Speculative decoding, lossless: DDTree draft trees (tree), one target pass over a tree (verify), the
acceptance walk and cache commit (accept), the decode loop (decode). numpy reference backend."""
from lucegen.spec_decode.accept import chosen, commit, walk
from lucegen.spec_decode.decode import Speculation, oracle_draft, speculative_generate, speculative_round
from lucegen.spec_decode.tree import Tree, build_tree
from lucegen.spec_decode.verify import tree_forward

__all__ = ["Speculation", "Tree", "build_tree", "chosen", "commit", "oracle_draft", "speculative_generate", "speculative_round",
           "tree_forward", "walk"]

"""Speculative decoding on the numpy reference: the DDTree builder, the tree forward, lossless greedy and sampled
decoding."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from lucegen.engine.sampling import SamplingParams, filtered_probs
from lucegen.model.config import tiny_config
from lucegen.reference import State, decode_step, generate, prefill, random_weights
from lucegen.spec_decode import (
    build_tree,
    commit,
    oracle_draft,
    speculative_generate,
    tree_forward,
)
from lucegen.engine.sampling import Sampler
from lucegen.spec_decode.decode import ORACLE_TOP, ReferenceVerifier, speculative_round
from lucegen.spec_decode.tree import TopK, top_k_ids
from lucegen.kernels import sample, topk

CFG = tiny_config()
WEIGHTS = random_weights(CFG, seed=1)
PROMPT = [5, 17, 3, 99, 250]
REF = generate(WEIGHTS, CFG, PROMPT, 48)


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def random_draft(seed: int = 0):
    rng = np.random.default_rng(seed)
    return lambda context, n: log_softmax(rng.normal(size=(n, CFG.vocab_size)) * 3)


def path_score(tree, lp, node) -> float:
    return sum(lp[tree.depths[n] - 1, tree.tokens[n]] for n in tree.path(node)[1:])


def check_structure(tree):
    for n in range(1, len(tree.tokens)):
        p = tree.parents[n]
        assert 0 <= p < n and tree.depths[n] == tree.depths[p] + 1 and tree.children[p][tree.tokens[n]] == n
    vis = tree.visibility()
    for n in range(len(tree.tokens)):
        np.testing.assert_array_equal(np.flatnonzero(vis[n]), tree.path(n))


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40, 155, 200])
def test_tree_is_the_top_budget_prefixes(budget):
    """Pure best-first = the budget most probable prefixes under the factorised draft (paper Prop. 2), checked
    against brute force over every prefix of a 5-token vocabulary, depth 3 (155 prefixes)."""
    lp = log_softmax(np.random.default_rng(budget).normal(size=(3, 5)) * 2)
    tree = build_tree(lp, budget, root=7, chain_seed=False)
    check_structure(tree)
    assert tree.tokens[0] == 7 and len(tree.tokens) == 1 + min(budget, 155)
    every = sorted((sum(lp[d, t] for d, t in enumerate(u))
                    for L in (1, 2, 3) for u in itertools.product(range(5), repeat=L)), reverse=True)
    got = sorted((path_score(tree, lp, n) for n in range(1, len(tree.tokens))), reverse=True)
    np.testing.assert_allclose(got, every[:budget], rtol=0, atol=1e-12)


@pytest.mark.parametrize("budget", [2, 4, 9, 30])
def test_chain_seed_and_chain(budget):
    lp = log_softmax(np.random.default_rng(budget).normal(size=(4, 6)) * 2)
    top1 = list(np.argmax(lp, axis=1))
    tree = build_tree(lp, budget)
    check_structure(tree)
    assert len(tree.tokens) == 1 + budget
    assert tree.tokens[1:1 + min(4, budget)] == top1[:budget]  # the chain comes first, node i at depth i
    chain = build_tree(lp, budget, top_k=1)
    assert chain.tokens[1:] == top1[:budget] and chain.parents == list(range(-1, len(chain.tokens) - 1))


def test_tree_forward_is_a_decode_step_per_ancestor_path():
    state = State()
    prefill(WEIGHTS, CFG, PROMPT, state)
    tree = build_tree(random_draft(3)(PROMPT, 4), 12, root=REF[0], chain_seed=False)
    assert max(len(c) for c in tree.children) > 1 and max(tree.depths) > 1  # branches and depth
    logits, nodes = tree_forward(WEIGHTS, CFG, state, tree.tokens, tree.parents)
    for n in range(len(tree.tokens)):
        path = [tree.tokens[a] for a in tree.path(n)]
        full = prefill(WEIGHTS, CFG, PROMPT + path)[-1]
        np.testing.assert_allclose(logits[n], full, rtol=1e-4, atol=1e-4 * np.abs(full).max())
        plain = state.copy()  # plain decoding of the path: bit-identical, and so is the committed state
        for token in path:
            expected = decode_step(WEIGHTS, CFG, token, plain)
        np.testing.assert_array_equal(logits[n], expected)
        committed = commit(state, nodes, tree.path(n))
        assert committed.position == plain.position
        for table in ("conv", "recurrent", "keys", "values"):
            a, b = getattr(committed, table), getattr(plain, table)
            assert a.keys() == b.keys() and all(np.array_equal(a[i], b[i]) for i in a)
    assert state.position == len(PROMPT) and state.keys[3].shape[0] == len(PROMPT)  # left unchanged


DRAFTS = {
    "perfect oracle": lambda: oracle_draft(REF, len(PROMPT), CFG.vocab_size, accuracy=1.0),
    "noisy oracle": lambda: oracle_draft(REF, len(PROMPT), CFG.vocab_size, accuracy=0.6, seed=1),
    "random": lambda: random_draft(2),
}


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_is_plain_greedy(draft, chain):
    assert speculative_generate(WEIGHTS, CFG, PROMPT, 48, DRAFTS[draft](), budget=24, chain=chain) == REF


@pytest.mark.parametrize("budget, chain", [(3, False), (3, True), (24, False)])
def test_a_round_drafts_no_deeper_than_its_budget(budget, chain):
    """A tree of `budget` nodes below the root is at most budget deep, so a round asks the draft for no more depths
    (the GPU draft's LM head then multiplies only those rows); the output is still plain greedy's."""
    oracle, asked = DRAFTS["perfect oracle"](), []

    def draft(context, n):
        asked.append(n)
        return oracle(context, n)
    assert speculative_generate(WEIGHTS, CFG, PROMPT, 48, draft, budget=budget, chain=chain) == REF
    assert max(asked) == min(15, budget) and all(1 <= n <= budget for n in asked)


class ArgmaxVerifier(ReferenceVerifier):
    """The reference verifier with the passes the GPU's TreeVerifier has: forward_argmax, forward_drawn (the sample
    kernel's reference), forward_top_k (topk's) and forward_rows. Records which pass each round took, and which
    nodes' rows it handed out."""
    max_top_k = 16

    def __init__(self, *args):
        super().__init__(*args)
        self.passes, self.rows_read = [], []

    def _pass(self, name, tokens, parents):
        self.passes.append(name)
        return super().forward(tokens, parents)

    def _rows(self, logits, parents):
        read = []
        self.rows_read.append((parents, read, logits))

        class Rows:
            def __getitem__(self, node):
                read.append(node)
                return logits[node]
        return Rows()

    def forward(self, tokens, parents):
        return self._pass("logits", tokens, parents)

    def forward_argmax(self, tokens, parents):
        return self._pass("argmax", tokens, parents).argmax(axis=-1)

    def forward_drawn(self, tokens, parents, temperature, uniforms):
        logits = self._pass("drawn", tokens, parents)
        return [sample.reference(row, temperature, u, blocks=5) for row, u in zip(logits, uniforms)]

    def forward_top_k(self, tokens, parents, k):
        assert k <= self.max_top_k
        logits = self._pass("top_k", tokens, parents)
        return *topk.reference(logits.astype(np.float32), k), self._rows(logits, parents)

    def forward_top_p(self, tokens, parents, temperature, k):
        assert k <= self.max_top_k
        logits = self._pass("top_p", tokens, parents)
        ids = topk.reference(logits.astype(np.float32), k)[0]
        softmax = [sample.softmax_of(*sample.parts(row, temperature, 5), temperature) for row in logits]
        return ids, np.take_along_axis(logits, ids, axis=1), softmax, self._rows(logits, parents)

    def forward_rows(self, tokens, parents):
        return self._rows(self._pass("rows", tokens, parents), parents)


def target_draft(context, n):
    """The target's own log-probs along its greedy continuation of the context: a draft whose trees a sampled
    target at a low temperature walks deep into."""
    state, rows = State(), []
    logits = prefill(WEIGHTS, CFG, context, state)[-1]
    for _ in range(n):
        rows.append(log_softmax(logits.astype(np.float64)))
        logits = decode_step(WEIGHTS, CFG, int(logits.argmax()), state)
    return np.array(rows).reshape(n, CFG.vocab_size)


def rounds(verifier, params, tokens=24):
    sampler = Sampler(params)
    out = [sampler(prefill(WEIGHTS, CFG, PROMPT, verifier.state)[-1])]
    lengths = []
    while len(out) < tokens:
        new = speculative_round(verifier, [*PROMPT, *out], 7, target_draft, 8, sampler)
        out += new
        lengths.append(len(new))
    return out, lengths


LAWS = {"greedy": (SamplingParams(temperature=0), "argmax"),
        "temperature": (SamplingParams(temperature=0.2, seed=3), "drawn"),
        "top_k": (SamplingParams(temperature=0.2, top_k=5, seed=3), "top_k"),
        "top_k top_p": (SamplingParams(temperature=0.5, top_k=9, top_p=0.7, seed=4), "top_k"),
        "top_k past the device's": (SamplingParams(temperature=0.2, top_k=16, seed=3), "rows"),
        "top_p": (SamplingParams(temperature=0.2, top_p=0.9, seed=3), "top_p"),
        "top_p past the device's": (SamplingParams(temperature=1.0, top_p=0.9, seed=3), "top_p")}


@pytest.mark.parametrize("law", LAWS)
def test_rounds_take_the_verifiers_pass_for_the_law_and_draw_the_hosts_tokens(law):
    """Greedy rounds walk the verifier's argmax ids (no N x vocab logits to the host) and give plain greedy
    decoding's tokens. Sampled rounds draw the tokens that drawing every node from its whole row on the host
    gives, from the same seed (the same uniforms, one a node walked): a temperature alone from the device's draws
    (a node drawn with its depth's uniform), top_k from the device's k + 1 best a node, top_p alone from its best and
    its softmax a node, and other laws (and a nucleus past the best) from the rows of the walk's nodes alone (each
    node once, a root-first chain of the tree)."""
    params, expected = LAWS[law]
    verifier = ArgmaxVerifier(WEIGHTS, CFG, State())
    out, lengths = rounds(verifier, params)
    assert set(verifier.passes) == {expected}
    if params.temperature == 0:
        assert out[:24] == REF[:24]
        return
    assert max(lengths) > 2 or "past" in law  # paths past depth 1 were walked
    assert (out, lengths) == rounds(ReferenceVerifier(WEIGHTS, CFG, State()), params)
    past = 0
    for parents, read, logits in verifier.rows_read:
        if expected == "rows":
            assert read[0] == 0 and len(set(read)) == len(read)
            assert all(parents[b] == a for a, b in zip(read, read[1:])), (parents, read)
        for node in read:  # top_k: none (no tie at the k-th); top_p: only rows whose nucleus is past the best
            if expected != "rows":
                nucleus = np.count_nonzero(filtered_probs(logits[node], params.temperature, 0, params.top_p))
                assert expected == "top_p" and nucleus > verifier.max_top_k, (law, node, nucleus)
                past += 1
    if law == "top_p past the device's":
        assert past > 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 9, 17])
def test_max_new_tokens(max_new_tokens):
    out = speculative_generate(WEIGHTS, CFG, PROMPT, max_new_tokens, DRAFTS["perfect oracle"](), budget=8)
    assert out == REF[:max_new_tokens]


@pytest.mark.parametrize("k", [0, 1, 6, 13])
def test_eos_ends_the_output(k):
    """EOS at the first occurrence of REF[k]; with a perfect oracle it lands inside accepted paths."""
    eos = REF[k]
    for draft in ("perfect oracle", "noisy oracle"):
        out = speculative_generate(WEIGHTS, CFG, PROMPT, 48, DRAFTS[draft](), budget=8, eos_token_id=eos)
        assert out == REF[:REF.index(eos) + 1]


def test_sampled_matches_plain_sampling():
    """The first 3 tokens (the prefill's draw, then the root's and a depth-1 node's, or the next round's root when
    the draw misses the tree) over 500 seeds against the exact plain-sampling law, on a 4-token vocabulary.

    Pearson chi-square over the 64 sequences (cells of expected count < 5 pooled), failing at p < 1e-4: a correct
    implementation fails with probability 1e-4 (the fixed seeds make it deterministic; the bound says a pass is not
    luck). Budget 2 puts 2 of the 4 tokens under the root, so both the accepted-child and the missed-tree paths run."""
    cfg = tiny_config(vocab_size=4)
    weights = random_weights(cfg, seed=2)
    prompt, params = [1, 2, 3], SamplingParams(temperature=1.0)

    def probs(context):
        return np.exp(log_softmax(prefill(weights, cfg, context)[-1].astype(np.float64)))

    law = {seq: 1.0 for seq in itertools.product(range(4), repeat=3)}
    for seq in law:
        for i in range(3):
            law[seq] *= probs(prompt + list(seq[:i]))[seq[i]]

    def draft(context, n):  # deterministic per context, sometimes right
        return log_softmax(np.random.default_rng(sum(context) * 31 + len(context)).normal(size=(n, 4)) * 2)

    n = 500
    counts = dict.fromkeys(law, 0)
    for seed in range(n):
        out = speculative_generate(weights, cfg, prompt, 3, draft, budget=2,
                                   sampling=SamplingParams(params.temperature, seed=seed))
        counts[tuple(out)] += 1
    expected = np.array([law[s] for s in law]) * n
    observed = np.array([counts[s] for s in law])
    small = expected < 5
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
    stat = ((observed - expected) ** 2 / expected).sum()
    assert chi2.sf(stat, len(expected) - 1) > 1e-4, stat


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 60), k=st.integers(0, 70), ties=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_top_k_ids_are_a_stable_sorts_first_k(rows, vocab, k, ties, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(-3, 3, (rows, vocab)).astype(np.float64) if ties else rng.standard_normal((rows, vocab))
    want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_k_ids(scores, k), want)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(2, 300), run=st.one_of(st.none(), st.integers(0, 4)), accuracy=st.sampled_from([0.0, 0.5, 1]),
       on_path=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_oracle_hands_over_the_top_of_its_whole_distribution(vocab, run, accuracy, on_path, seed):
    """The TopK is the first columns of a stable sort of the oracle's row over the whole vocabulary, normalised
    over all of it; with a vocabulary within ORACLE_TOP the row is all there, so it can be checked whole."""
    rng = np.random.default_rng(seed)
    target = [int(t) for t in rng.integers(0, vocab, 12)]
    context = [1, 2, *(target[:3] if on_path else [(target[0] + 1) % vocab, 0, 0])]
    top = oracle_draft(target, 2, vocab, accuracy=accuracy, seed=seed, run=run)(context, 5)
    assert isinstance(top, TopK) and top.ids.shape == top.logprobs.shape == (5, min(vocab, ORACLE_TOP))
    for ids, lps in zip(top.ids, top.logprobs):
        assert len(set(ids.tolist())) == len(ids)
        assert all(x > y or (x == y and a < b) for a, b, x, y in zip(ids, ids[1:], lps, lps[1:]))  # stable order
        if vocab <= ORACLE_TOP:  # the whole row: a distribution, and the stable order of it
            dense = np.empty(vocab)
            dense[ids] = lps
            assert abs(np.log(np.exp(dense).sum())) < 1e-9
            np.testing.assert_array_equal(ids, top_k_ids(dense[None], vocab)[0])
        else:  # the mass not handed over: the other tokens, none above the last one handed over (the float64 sum
            # of len(lps) terms near 1 is exact to len(lps) ulps of 1)
            rest = 1 - np.exp(lps).sum()
            assert -len(lps) * 2.0**-52 < rest <= (vocab - len(lps)) * np.exp(lps[-1]) + len(lps) * 2.0**-52
    if on_path and accuracy == 1 and (run is None or run > 0) and vocab > 1:
        assert top.ids[0, 0] == target[3]  # the true next token (after the 3 on the path) first


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 300), accuracy=st.sampled_from([0.3, 0.8]), start=st.integers(0, 8),
       depths=st.lists(st.integers(1, 9), min_size=2, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_the_oracles_word_on_a_position_does_not_depend_on_the_calls(vocab, accuracy, start, depths, seed):
    """A position's rows are the same whatever the call's depth and whatever calls came before (lucegen tune's
    budgets draft different depths a round; they must meet the same right and wrong guesses)."""
    rng = np.random.default_rng(seed)
    target = [int(t) for t in rng.integers(0, vocab, 20)]
    context = [1, 2, *target[:start]]
    alone = {n: oracle_draft(target, 2, vocab, accuracy=accuracy, seed=seed)(context, n) for n in depths}
    shared = oracle_draft(target, 2, vocab, accuracy=accuracy, seed=seed)
    deepest = alone[max(depths)]
    for n in depths:
        for top in (alone[n], shared(context, n)):  # alone, and after the shared oracle's earlier calls
            np.testing.assert_array_equal(top.ids, deepest.ids[:n])
            np.testing.assert_array_equal(top.logprobs, deepest.logprobs[:n])

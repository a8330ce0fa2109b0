"""The recurrent core (`modeling/recurrent_core.py`) against transformers 5's own functions of the same
rules, made inside the test (run under transformers 5: `hf_models.recurrent_rule_answers`): Qwen3.5's
gated delta rule with fewer key heads than value heads, Kimi Linear's with a decay per key channel,
each chunked with chunks that do not divide the length (all at once, and span by span with each span
run again in the backward), and token by token; the rule without its delta term is Nemotron-H's
Mamba-2 scan (transformers' `mamba2_chunk_scan`, with B and C in fewer groups than heads). Packed
documents give each document's own outputs, and the rule without its delta term its token-by-token
definition; parts of a sequence run from their folded summaries give the whole run (context
parallelism's algebra). Forward within 1e-5, gradients of every input within 1e-4 (fp32)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.recurrent_core import chunked, fold_states, part_summary, recurrent_reference

import hf_models

FORWARD_TOL, GRADIENT_TOL = 1e-5, 1e-4
RULE_INPUTS = hf_models.RULE_INPUTS
# rule: (batch, tokens, key heads, value heads, d_k, d_v, chunk, decay per key channel)
# chunked forms: every chunk in one span (all at once), or one chunk per span (recomputed span by span)
SPAN_CHUNKS = {"chunked": 16, "spans": 1}
CASES = {"gated_delta": (2, 37, 2, 4, 8, 6, 16, False), "kimi_delta": (2, 29, 3, 3, 8, 6, 8, True)}


def _inputs(rule: str, seed: int = 0) -> dict[str, np.ndarray]:
    batch, tokens, key_heads, value_heads, d_k, d_v, chunk, per_channel = CASES[rule]
    rng = np.random.default_rng(seed)
    unit = lambda shape: (lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True))(rng.standard_normal(shape))  # noqa: E731
    decay_shape = (batch, tokens, value_heads) + ((d_k,) if per_channel else ())
    return {"q": unit((batch, tokens, key_heads, d_k)), "k": unit((batch, tokens, key_heads, d_k)),
            "v": rng.standard_normal((batch, tokens, value_heads, d_v)),
            "g": -np.abs(rng.standard_normal(decay_shape)) * (0.5 if per_channel else 1.0),
            "beta": 1 / (1 + np.exp(-rng.standard_normal((batch, tokens, value_heads)))),
            "w": rng.standard_normal((batch, tokens, value_heads, d_v)), "chunk": np.array(chunk)}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Per rule: (the inputs, transformers 5's answers on them)."""
    folder = tmp_path_factory.mktemp("recurrent_rules")
    out = {}
    for rule in CASES:
        given = {key: value.astype(np.float32) for key, value in _inputs(rule).items()}
        np.savez(folder / f"{rule}.npz", **given)
        hf_models.transformers5("recurrent_rule", rule, folder / f"{rule}.npz", folder / f"{rule}_answers.npz")
        out[rule] = given, dict(np.load(folder / f"{rule}_answers.npz"))
    return out


def _ours(given: dict, form: str, segments: np.ndarray | None = None, with_delta: bool = True):
    """Our output, final state and gradients of (output * w).sum() on transformers' inputs: their
    query scale d_k^-1/2 is the mixer's here, so the query enters scaled."""
    tensors = {key: paddle.to_tensor(given[key]) for key in RULE_INPUTS}
    for tensor in tensors.values():
        tensor.stop_gradient = False
    scale = given["q"].shape[-1] ** -0.5
    args = (tensors["q"] * scale, tensors["k"], tensors["v"], tensors["g"], tensors["beta"] if with_delta else None)
    kwargs = {"segments": None if segments is None else paddle.to_tensor(segments)}
    if form == "token":
        output, state = recurrent_reference(*args, **kwargs)
    else:
        output, state = chunked(*args, chunk_size=int(given["chunk"]), span_chunks=SPAN_CHUNKS[form], **kwargs)
    (output * paddle.to_tensor(given["w"])).sum().backward()
    grads = {key: tensor.grad.numpy() for key, tensor in tensors.items() if tensor.grad is not None}
    return output.numpy(), state.numpy(), grads


@pytest.mark.parametrize("form", ["chunked", "spans", "token"])
@pytest.mark.parametrize("rule", list(CASES))
def test_the_rule_is_transformers_own_forward_and_backward(answers, rule, form):
    given, theirs = answers[rule]
    output, state, grads = _ours(given, form)
    answer = "token" if form == "token" else "chunked"
    np.testing.assert_allclose(output, theirs[f"{answer}_output"], rtol=FORWARD_TOL, atol=FORWARD_TOL)
    np.testing.assert_allclose(state, theirs[f"{answer}_state"], rtol=FORWARD_TOL, atol=FORWARD_TOL)
    for key in RULE_INPUTS:
        np.testing.assert_allclose(grads[key], theirs[f"{answer}_d{key}"], rtol=GRADIENT_TOL, atol=GRADIENT_TOL,
                                   err_msg=key)


@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("rule", list(CASES))
def test_spans_carry_a_given_state_and_its_gradient_both_ways(rule, with_delta):
    """Run span by span from a given state, with a gradient arriving on the final state as well as on
    the outputs (a caller that carries the state on, as a context-parallel rank does): output, final
    state and the gradients of every input and of the initial state are the token-by-token run's."""
    given = {key: value.astype(np.float32) for key, value in _inputs(rule, seed=7).items()}
    rng = np.random.default_rng(8)
    heads, d_k, d_v = given["v"].shape[2], given["k"].shape[-1], given["v"].shape[-1]
    start, toward = (rng.standard_normal((given["v"].shape[0], heads, d_k, d_v)).astype(np.float32) for _ in range(2))
    results = []
    for form in ("spans", "token"):
        tensors = {key: paddle.to_tensor(given[key], stop_gradient=False) for key in RULE_INPUTS}
        tensors["state"] = paddle.to_tensor(start, stop_gradient=False)
        args = (tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"] if with_delta else None)
        output, state = (chunked(*args, initial_state=tensors["state"], chunk_size=int(given["chunk"]), span_chunks=1)
                         if form == "spans" else recurrent_reference(*args, initial_state=tensors["state"]))
        ((output * paddle.to_tensor(given["w"])).sum() + (state * paddle.to_tensor(toward)).sum()).backward()
        results.append([output.numpy(), state.numpy()] + [tensor.grad.numpy() for tensor in tensors.values()
                                                          if tensor.grad is not None])
    assert len(results[0]) == len(results[1]) == 7 + with_delta
    for index, (ours, reference) in enumerate(zip(*results)):
        tol = FORWARD_TOL if index < 2 else GRADIENT_TOL
        np.testing.assert_allclose(ours, reference, rtol=tol, atol=tol, err_msg=str(index))


@pytest.mark.parametrize("form", ["chunked", "spans"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("rule", list(CASES))
def test_packed_documents_each_run_as_if_alone(rule, with_delta, form):
    """Documents ending inside and at chunk (and span) edges: the chunked output is each document's run
    alone, token by token; its gradients are the token-by-token run's over the packed sequence."""
    given = {key: value.astype(np.float32) for key, value in _inputs(rule, seed=3).items()}
    chunk = int(given["chunk"])
    segments = np.zeros(given["v"].shape[:2], np.int64)
    segments[0, 5:], segments[0, chunk:], segments[0, chunk + 3:] = 1, 2, 3
    segments[1, 2 * chunk - 1:] = 1
    output, state, grads = _ours(given, form, segments, with_delta)
    _, _, token_grads = _ours(given, "token", segments, with_delta)
    for key in grads:
        np.testing.assert_allclose(grads[key], token_grads[key], rtol=GRADIENT_TOL, atol=GRADIENT_TOL, err_msg=key)
    for row in range(segments.shape[0]):
        for document in np.unique(segments[row]):
            span = np.flatnonzero(segments[row] == document)
            alone = {key: value[row:row + 1, span[0]:span[-1] + 1] for key, value in given.items() if key != "chunk"}
            expected, _, _ = _ours({**alone, "chunk": given["chunk"]}, "token", with_delta=with_delta)
            np.testing.assert_allclose(output[row:row + 1, span[0]:span[-1] + 1], expected, rtol=FORWARD_TOL,
                                       atol=FORWARD_TOL, err_msg=f"row {row} document {document}")


@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("rule", list(CASES))
def test_parts_run_from_their_folded_summaries_give_the_whole_run(rule, with_delta):
    """Context parallelism's algebra without a ring: each part of a sequence summarised alone as
    (T, L) (`part_summary`), the summaries folded in order into the state before each part
    (`fold_states`), each part run from it: the whole sequence's outputs and the gradients of every
    input, with a document ending inside a part and, in one row of the batch only, one starting
    exactly at a part's first token (the fold restarts that row)."""
    given = _inputs(rule, seed=5)
    chunk, tokens = int(given["chunk"]), given["v"].shape[1]
    bounds = [0, tokens // 4, tokens // 2, 3 * tokens // 4, tokens]
    segments = np.zeros(given["v"].shape[:2], np.int64)
    segments[:, bounds[1] + 3:], segments[0, bounds[2]:] = 1, 2
    segments = paddle.to_tensor(segments)
    results = []
    for form in ("whole", "parts"):
        inputs = {key: paddle.to_tensor(given[key].astype(np.float32), stop_gradient=False) for key in RULE_INPUTS}
        q, k, v, g = inputs["q"] * given["q"].shape[-1] ** -0.5, inputs["k"], inputs["v"], inputs["g"]
        beta = inputs["beta"] if with_delta else None
        if form == "whole":
            output, _ = chunked(q, k, v, g, beta, segments=segments, chunk_size=chunk)
        else:
            part = lambda x, start, end: None if x is None else x[:, start:end]  # noqa: E731
            spans = list(zip(bounds, bounds[1:]))
            summaries = [part_summary(part(k, a, b), part(v, a, b), part(g, a, b), part(beta, a, b),
                                      part(segments, a, b), chunk_size=chunk) for a, b in spans]
            starts = [False] + [segments[:, a] != segments[:, a - 1] for a, _ in spans[1:]]
            assert [bool(flag.any()) if flag is not False else False for flag in starts] == [False, False, True, False]
            output = paddle.concat([chunked(part(q, a, b), part(k, a, b), part(v, a, b), part(g, a, b), part(beta, a, b),
                                            initial_state=state, segments=part(segments, a, b), chunk_size=chunk)[0]
                                    for (a, b), state in zip(spans, fold_states(summaries, starts))], axis=1)
        (output * paddle.to_tensor(given["w"].astype(np.float32))).sum().backward()
        results.append([output.numpy()] + [inputs[key].grad.numpy() for key in RULE_INPUTS
                                           if inputs[key].grad is not None])
    for index, (parts, whole) in enumerate(zip(results[1], results[0])):
        tol = FORWARD_TOL if index == 0 else GRADIENT_TOL
        np.testing.assert_allclose(parts, whole, rtol=tol, atol=tol, err_msg=str(index))


@pytest.fixture(scope="module")
def ssd(tmp_path_factory) -> tuple[dict, dict]:
    """Mamba-2's scan inputs (2 groups of B and C for 4 heads, chunks of 8 over 29 tokens) and
    transformers 5's answers on them."""
    folder = tmp_path_factory.mktemp("ssd")
    rng = np.random.default_rng(11)
    batch, tokens, heads, groups, head_dim, state_size = 2, 29, 4, 2, 6, 8
    given = {"x": rng.standard_normal((batch, tokens, heads, head_dim)),
             "dt": np.log1p(np.exp(rng.standard_normal((batch, tokens, heads)))), "A": -np.exp(rng.standard_normal(heads)),
             "B": rng.standard_normal((batch, tokens, groups, state_size)),
             "C": rng.standard_normal((batch, tokens, groups, state_size)),
             "w": rng.standard_normal((batch, tokens, heads, head_dim))}
    given = {key: value.astype(np.float32) for key, value in given.items()} | {"chunk": np.array(8)}
    np.savez(folder / "ssd.npz", **given)
    hf_models.transformers5("ssd", folder / "ssd.npz", folder / "answers.npz")
    return given, dict(np.load(folder / "answers.npz"))


@pytest.mark.parametrize("form", ["chunked", "spans", "token"])
def test_without_the_delta_term_the_rule_is_mamba2s_scan(ssd, form):
    """Mamba-2 as its mixer hands the rule (`blocks/mamba2.py`: q = C, k = B, v = dt x, g = dt A) against
    transformers 5's scan on the same inputs: output and final state (1e-5), the gradients of x, dt,
    A, B and C (1e-4)."""
    given, theirs = ssd
    tensors = {key: paddle.to_tensor(given[key], stop_gradient=False) for key in hf_models.SSD_INPUTS}
    x, dt, a = tensors["x"], tensors["dt"], tensors["A"]
    args = (tensors["C"], tensors["B"], x * dt.unsqueeze(-1), dt * a, None)
    output, state = recurrent_reference(*args) if form == "token" else \
        chunked(*args, chunk_size=int(given["chunk"]), span_chunks=SPAN_CHUNKS[form])
    (output * paddle.to_tensor(given["w"])).sum().backward()
    np.testing.assert_allclose(output.numpy(), theirs["output"], rtol=FORWARD_TOL, atol=FORWARD_TOL)
    np.testing.assert_allclose(state.numpy(), theirs["state"].transpose(0, 1, 3, 2), rtol=FORWARD_TOL, atol=FORWARD_TOL)
    for key, tensor in tensors.items():
        np.testing.assert_allclose(tensor.grad.numpy(), theirs[f"d{key}"], rtol=GRADIENT_TOL, atol=GRADIENT_TOL,
                                   err_msg=key)

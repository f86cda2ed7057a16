"""Position maps (``eval.position_map``: SelfExtend, DCA, ReRoPE, STRING): each map's distances equal a
float64 reference of its paper's formula, attention under a map equals a float64 reference for rotary and
bias PEs, cached decoding equals the full forward, and what cannot take a map is refused in one line."""

from __future__ import annotations

import pytest
import torch

from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model
from posformer.model.attention import attend
from posformer.model.backends import choose
from posformer.model.context import AttentionContext
from posformer.model.remap import parse_position_map
from posformer.pe import build_encoding

MAPS = {
    "selfextend": {"kind": "selfextend", "group": 3, "window": 5},
    "dca": {"kind": "dca", "chunk_size": 6, "local_window": 2},
    "rerope": {"kind": "rerope", "window": 4},
    "string": {"kind": "string", "shift": 7, "window": 2},
}


def reference_pair(kind: str, i: float, j: float) -> tuple[float, float]:
    """The paper's (query position, key position) of the pair (i, j), written out in float64 scalars."""
    d = i - j
    if kind == "selfextend":  # Jin et al. 2024, eq. (3): neighbour window W, group G
        g, w = 3, 5
        return (i, j) if d < w else (i // g + w - w // g, j // g)
    if kind == "dca":  # An et al. 2024, sec. 3: P_k = j mod s; intra / successive / inter query indices
        s, w = 6, 2
        c = s + w
        a, b = i // s, j // s
        q = i % s if a == b else (min(i % s + s, c - 1) if a - b == 1 else c - 1)
        return q, j % s
    if kind == "rerope":  # Su 2023: relative position min(i - j, w)
        return (i, j) if d < 4 else (4.0, 0.0)
    s, w = 7, 2  # STRING: d >= S is shifted to d - S + W
    return (i, j) if d < s else (i - s + w, j)


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_distances_equal_the_papers_formula(kind: str, dtype: torch.dtype) -> None:
    pm = parse_position_map(MAPS[kind])
    q = torch.arange(3, 29, dtype=dtype).view(1, -1)  # offset positions, as a decoding cache continues
    k = torch.arange(0, 29, dtype=dtype).view(1, -1)
    got = pm.distance(q, k).double()
    want = torch.tensor(
        [[[(lambda p: p[0] - p[1])(reference_pair(kind, float(i), float(j))) for j in k[0]] for i in q[0]]],
        dtype=torch.float64,
    )
    causal = q[0].view(-1, 1) >= k[0].view(1, -1)
    torch.testing.assert_close(got[0][causal], want[0][causal], rtol=0, atol=1e-6)
    if kind in ("selfextend", "rerope", "string"):  # near keys keep their distance
        assert torch.equal(
            got[0][causal & (got[0] < 2)],
            (q[0].view(-1, 1) - k[0].view(1, -1))[causal & (got[0] < 2)].double(),
        )


def _reference_attention(pe, kind, q, k, v) -> torch.Tensor:
    """softmax over j <= i of (rot(q_i, q') · rot(k_j, k'))/√Dh + bias(q', k'), every pair at its paper
    positions, in float64."""
    b, h, t, dh = q.shape
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    rotary = "rotary" in pe.caps.hooks
    for i in range(t):
        scores = []
        for j in range(i + 1):
            qp, kp = reference_pair(kind, float(i), float(j))
            qpos = torch.tensor([[qp]], dtype=torch.float64)
            kpos = torch.tensor([[kp]], dtype=torch.float64)
            qi, kj = q[:, :, i : i + 1], k[:, :, j : j + 1]
            if rotary:
                qi, kj = pe.rotate(qi, qpos, is_query=True), pe.rotate(kj, kpos, is_query=False)
            s = (qi * kj).sum(-1)[..., 0] / dh**0.5  # (B, H)
            if "bias" in pe.caps.hooks:
                s = s + pe.bias(qpos, kpos).double()[:, :, 0, 0]
            scores.append(s)
        p = torch.stack(scores, -1).softmax(-1)  # (B, H, i+1)
        out[:, :, i] = (p.unsqueeze(-1) * v[:, :, : i + 1]).sum(-2)
    return out


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize(
    "pe_name", ["rope", "alibi", "t5", "fire", "kerple", "xpos", "pope", "dpb", "sandwich"]
)
def test_attention_under_a_map_equals_a_float64_reference(kind: str, pe_name: str) -> None:
    torch.manual_seed(0)
    pe = build_encoding(pe_name, d_model=16, n_heads=2, causal=True).double()
    pm = parse_position_map(MAPS[kind])
    t = 20
    q, k, v = (torch.randn(2, 2, t, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(t).view(1, -1)
    ctx = AttentionContext(pe, pos, pos, causal=True, position_map=pm)
    got = attend(ctx.rotate(q, pos, is_query=True), ctx.rotate(k, pos, is_query=False), v, ctx)
    torch.testing.assert_close(got, _reference_attention(pe, kind, q, k, v), rtol=0, atol=1e-6)
    assert choose(q, k, ctx, dropout_p=0.0, device_type="cpu") == "remapped"
    # the map changes the attention (the sequence reaches past every map's window)
    plain = AttentionContext(pe, pos, pos, causal=True)
    unmapped = attend(plain.rotate(q, pos, is_query=True), plain.rotate(k, pos, is_query=False), v, plain)
    assert not torch.allclose(got, unmapped, atol=1e-4)


def _model(pe: str, **extra) -> torch.nn.Module:
    cfg = ModelConfig(
        kind="decoder", vocab_size=17, d_model=16, n_heads=2, n_layers=2, pe=pe, dropout=0.0, **extra
    )
    return build_model(cfg).eval()


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("pe", ["rope", "t5", "fire"])
def test_cached_decoding_equals_the_full_forward(kind: str, pe: str) -> None:
    torch.manual_seed(0)
    model = _model(pe)
    model.position_map = parse_position_map(MAPS[kind])
    ids = torch.randint(0, 17, (2, 22))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :6], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(6, 22)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_a_model_without_a_map_is_unchanged() -> None:
    torch.manual_seed(0)
    model = _model("rope")
    ids = torch.randint(0, 17, (1, 12))
    with torch.no_grad():
        before = model(ids)
        model.position_map = parse_position_map({"kind": "selfextend", "group": 2, "window": 100})
        same = model(ids)  # every distance within the window: the ordinary attention
        model.position_map = None
        again = model(ids)
    torch.testing.assert_close(same, before, rtol=0, atol=1e-5)
    assert torch.equal(again, before)


@pytest.mark.parametrize(
    ("pe", "extra", "words"),
    [
        ("sinusoidal", {}, ["pe='sinusoidal'", "embeddings"]),
        ("learned", {"pe_options": {"max_len": 64}}, ["pe='learned'", "embeddings"]),
        ("cope", {}, ["pe='cope'"]),
        ("shaw", {}, ["pe='shaw'"]),
        ("nope", {}, ["no effect"]),
    ],
)
def test_what_cannot_take_a_map_is_one_line(pe: str, extra: dict, words: list[str]) -> None:
    model = _model(pe, **extra)
    with pytest.raises(ConfigError) as err:
        model.position_map = parse_position_map("selfextend")
    line = str(err.value)
    assert "\n" not in line and "eval.position_map=selfextend(" in line, line
    assert all(w in line for w in words), line


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"kind": "selfextnd"}, ["kind='selfextnd'", "valid: selfextend, dca, rerope, string"]),
        ({"kind": "dca", "window": 3}, ["no option 'window'", "chunk_size, local_window"]),
        ({"kind": "selfextend", "group": 0}, ["group=0", "positive integer"]),
        ({"kind": "string", "shift": 4, "window": 4}, ["window=4 must be below shift=4"]),
    ],
)
def test_bad_map_options_are_one_line(raw: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_position_map(raw)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_encoder_decoder_is_refused() -> None:
    cfg = ModelConfig(
        kind="encoder_decoder",
        vocab_size=17,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        pe="rope",
    )
    with pytest.raises(ConfigError, match="decoder-only"):
        build_model(cfg).position_map = parse_position_map("rerope")

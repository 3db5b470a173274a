"""The hand-written backward passes of the model code against autograd's own graph."""

import torch
import torch.nn.functional as F

from hpcps.models import MatrixFactorization, embedding_penalty
from hpcps.models.dlrm import DLRM, mlp, pair_spread, pairwise_dots
from hpcps.nn.sharded import _gather


def test_pairwise_dots_match_bmm_of_the_lower_triangle():
    torch.manual_seed(0)
    T = torch.randn(32, 6, 5, dtype=torch.float64, requires_grad=True)
    i, j = torch.tril_indices(6, 6, offset=-1)
    want = torch.bmm(T, T.transpose(1, 2))[:, i, j]
    got = pairwise_dots(T, i * 6 + j)
    assert torch.equal(got, want)
    g = torch.randn_like(want)
    (gw,) = torch.autograd.grad(want, T, g)
    (gg,) = torch.autograd.grad(got, T, g)
    torch.testing.assert_close(gg, gw, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: pairwise_dots(x, torch.tensor([1, 7, 11])),
                                    (torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True),))
    # float32: the mirrored copy gives the bits of (G + G^T) T, the sum it replaced
    T32 = T.detach().float().requires_grad_()
    g32 = g.float()
    (got32,) = torch.autograd.grad(pairwise_dots(T32, i * 6 + j), T32, g32)
    G = torch.zeros(32, 36).index_copy_(1, i * 6 + j, g32).view(32, 6, 6)
    assert torch.equal(got32, torch.bmm(G + G.transpose(1, 2), T32.detach()))
    # the spread matrix DLRM keeps as a buffer: a 1 at each pair and at its mirror, nothing else
    spread = pair_spread(i * 6 + j, 6)
    assert spread.shape == (15, 36) and torch.equal(spread.sum(1), torch.full((15,), 2.0))
    assert torch.equal(spread[torch.arange(15), j * 6 + i], torch.ones(15))
    assert torch.equal(torch.mm(g32, spread).view(32, 6, 6), G + G.transpose(1, 2))
    (given,) = torch.autograd.grad(pairwise_dots(T32, i * 6 + j, spread), T32, g32)
    assert torch.equal(given, got32)


def test_gather_matches_embedding_with_repeated_rows():
    torch.manual_seed(1)
    w = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 3], [3, 3], [9, 0]])
    g = torch.randn(3, 2, 4, dtype=torch.float64)
    want, got = F.embedding(index, w), _gather(w, index)
    assert torch.equal(got, want)
    (gw,) = torch.autograd.grad(want, w, g)
    (gg,) = torch.autograd.grad(got, w, g)
    torch.testing.assert_close(gg, gw)
    assert gg[[1, 2, 4]].abs().sum() == 0          # rows nobody read get no gradient
    with torch.no_grad():                          # evaluation: no graph, the same values
        assert torch.equal(_gather(w, index), want)


def test_dlrm_gradients_equal_the_plain_autograd_model():
    """The DLRM with its custom interaction gives the gradients of the textbook expression."""
    torch.manual_seed(2)
    embs = [torch.nn.EmbeddingBag(20, 8, mode="sum") for _ in range(3)]
    m = DLRM(embs, 5, 8, bottom_mlp=(16,), top_mlp=(16,)).double()
    dense = torch.randn(40, 5, dtype=torch.float64)
    sparse = [torch.randint(0, 20, (40,)) for _ in range(3)]
    out = m(dense, sparse)
    got = torch.autograd.grad(out.sum(), list(m.parameters()))

    x = m.bottom(dense)
    T = torch.stack([x] + [e(s.view(-1, 1)) for e, s in zip(m.embeddings, sparse)], dim=1)
    i, j = torch.tril_indices(4, 4, offset=-1)
    ref = m.top(torch.cat([x, torch.bmm(T, T.transpose(1, 2))[:, i, j]], dim=1)).squeeze(1)
    want = torch.autograd.grad(ref.sum(), list(m.parameters()))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_embedding_penalty_counts_each_occurrence_and_dropout_sits_after_hidden_layers():
    torch.manual_seed(0)
    embs = [torch.nn.EmbeddingBag(10, 3, mode="sum", sparse=True) for _ in range(2)] + \
           [torch.nn.EmbeddingBag(10, 1, mode="sum", sparse=True) for _ in range(2)]
    mf = MatrixFactorization(embs)
    users, items = torch.tensor([1, 1, 4]), torch.tensor([2, 5, 5])
    mf(None, [users, items])
    w = [e.weight.detach() for e in embs]
    want = sum(float(w[k][ids].pow(2).sum()) for k, ids in ((0, users), (1, items), (2, users), (3, items)))
    assert abs(float(embedding_penalty(mf).detach()) - want) < 1e-5         # user 1 and item 5 count twice
    kinds = [type(m).__name__ for m in mlp([4, 8, 8, 1], last_activation=False, dropout=0.2)]
    assert kinds == ["Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    assert "Dropout" not in [type(m).__name__ for m in mlp([4, 8, 1], last_activation=False)]

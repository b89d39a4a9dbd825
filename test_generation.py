"""Generation (generation.py): a batch of prompts of different lengths, sampling, stop, and the errors.
That the KV cache gives what recomputation gives, and that no row of a batch reads another, are promises of every
method: test_lime.py holds them."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import small_model, tokens
import generation
from generation import KVCache, generate


def test_prompts_of_different_lengths_share_a_batch_as_if_each_ran_alone():
    model = small_model("lime").eval()  # generate's own work: a method's part (rows apart, the cache) is test_lime.py's
    prompts = [tokens(B=1, T=n, seed=n)[0] for n in (3, 7, 5)]
    idx = torch.stack([torch.cat([p, p.new_zeros(7 - len(p))]) for p in prompts])  # (3, 7), padded on the right
    out = generate(model, idx, 10, temperature=0, lengths=[3, 7, 5])
    assert out.shape == (3, 17)
    for row, prompt in zip(out, prompts):
        alone = generate(model, prompt[None], 10, temperature=0)[0]
        assert torch.equal(row[:len(alone)], alone)
    stop = out[0, 5].item()  # the first row's third new token: it ends there, the others go on
    stopped = generate(model, idx, 10, temperature=0, lengths=[3, 7, 5], stop=stop)
    assert torch.equal(stopped, out[:, :stopped.shape[1]]) and stopped.shape[1] > 6


def test_generate_sampling_and_length_check():
    model = small_model("lime").eval()
    torch.manual_seed(3)
    a = generate(model, tokens(T=4), 8, temperature=1.0, top_k=5)
    torch.manual_seed(3)
    b = generate(model, tokens(T=4), 8, temperature=1.0, top_k=5)
    assert a.shape == (2, 12) and torch.equal(a, b)
    greedy = generate(model, tokens(T=4), 8, temperature=0)  # the limit of a temperature near 0, with no NaN on the way
    assert torch.equal(generate(model, tokens(T=4), 8, temperature=1e-300), greedy)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, tokens(T=30), 5)
    with pytest.raises(ValueError, match="top_k=0"):
        generate(model, tokens(T=4), 2, top_k=0)
    for temperature in (-1, float("nan")):  # (NaN: no number at all, not a temperature of 0 or more)
        with pytest.raises(ValueError, match=f"temperature={temperature}: 0 .greedy. or more"):
            generate(model, tokens(T=4), 2, temperature=temperature)


class Counter:
    """A stand-in for a model whose next token is certain: the last token plus 1 (mod vocab)."""

    def __init__(self, vocab=10, block_size=32):
        self.config = SimpleNamespace(n_layer=1, block_size=block_size)
        self.vocab = vocab

    def __call__(self, idx, cache=None):
        cache.pos += idx.shape[1]
        return 10.0 * F.one_hot((idx + 1) % self.vocab, self.vocab).float(), None


def test_stop_ends_the_batch_once_every_row_has_generated_it():
    model = Counter()
    # row 0 counts 1 2 3 and stops; row 1 goes on to 6 7 8 9 0 1 2 3, 8 new tokens, and then the batch ends
    assert generate(model, torch.tensor([[0], [5]]), 20, temperature=0, stop=3).tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 0, 1, 2, 3]]
    # what the model predicts inside a row's prompt is not generated: row 1's prompt is 0 5 6, though the model
    # predicted the stop token 1 after its 0; its first 1 is the one it generates after 6 7 8 9 0
    prompts = torch.tensor([[0, 0, 0], [0, 5, 6]])
    assert generate(model, prompts, 20, temperature=0, stop=1, lengths=[1, 3]).tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7], [0, 5, 6, 7, 8, 9, 0, 1]]
    assert generate(model, torch.tensor([[0]]), 5, temperature=0, stop=9).tolist() == [[0, 1, 2, 3, 4, 5]]  # never
    # a temperature near 0 on logits 10 apart (10 / 1e-38 is past float32's range): greedy, not inf - inf = NaN
    assert generate(model, torch.tensor([[0]]), 3, temperature=1e-300).tolist() == [[0, 1, 2, 3]]


class Fixed:
    """A stand-in for a model whose next-token distribution is always `probs`."""

    def __init__(self, probs, block_size=32):
        self.config = SimpleNamespace(n_layer=1, block_size=block_size)
        self.logits = probs.log()

    def __call__(self, idx, cache=None):
        cache.pos += idx.shape[1]
        return self.logits.expand(*idx.shape, -1), None


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, None), (2.0, None), (2.0, 2), (1.0, 1), (0.7, 3),
                                                      (1.0, 10)])  # (top 10 of 4 tokens: all 4)
def test_sampling_follows_the_temperature_and_top_k(temperature, top_k):
    """Each token's frequency over many rows against p^(1/temperature) over the top_k tokens, renormalised
    (seeded: the counts are the same at every run, 4 standard deviations or more from failing)."""
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])  # top 1: token 1; top 2: 1 and 3; top 3: 1, 3 and 2
    expected = probs ** (1 / temperature)
    if top_k is not None:
        expected[probs.argsort(descending=True)[top_k:]] = 0
    expected /= expected.sum()
    torch.manual_seed(0)
    out = generate(Fixed(probs), torch.zeros(4000, 1, dtype=torch.long), 1, temperature=temperature, top_k=top_k)
    freq = torch.bincount(out[:, 1], minlength=4) / 4000
    assert torch.all(freq[expected == 0] == 0)  # never a token outside the top k
    assert (freq - expected).abs().max() < 0.03, (freq, expected)



def test_the_cache_holds_the_positions_generate_fills(monkeypatch):
    """The cache holds the positions generate() feeds the model, not block_size: a model of 32 positions that
    writes 12 feeds it 11 (never the last token) and holds 11 of K/V a layer, every one filled. A cache asked to
    hold more than it was made for says so."""
    model, made = small_model("lime").eval(), []

    def recorded(config, length):
        made.append(KVCache(config, length))
        return made[-1]

    monkeypatch.setattr(generation, "KVCache", recorded)
    generate(model, tokens(T=4), 8, temperature=0)
    assert [(c.k.shape[-2], c.pos) for c in made] == [(11, 11)] and model.config.block_size > 12
    generate(model, tokens(T=4), 8, temperature=0, lengths=[2, 4])  # rows of different lengths: the same positions
    assert [(c.k.shape[-2], c.pos) for c in made[1:]] == [(11, 11)]
    cache = KVCache(model.config, 5)
    model(tokens(T=5), cache=cache)
    with pytest.raises(ValueError, match="the cache holds 5 positions, not 6"):
        model(tokens(T=1), cache=cache)

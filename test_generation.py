"""Generation (generation.py): a batch of prompts of different lengths, sampling, stop, and the errors.
That the KV cache gives what recomputation gives is a promise of every method: test_lime.py holds it."""

import pytest
import torch

from conftest import small_model, tokens
from generation import generate


@pytest.mark.parametrize("mode", ["none", "lime", "dynamic"])
def test_prompts_of_different_lengths_share_a_batch_as_if_each_ran_alone(mode):
    model = small_model(mode).eval()
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
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, tokens(T=4), 2, temperature=-1)

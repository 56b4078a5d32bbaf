"""The host offload of checkpointed blocks' inputs on its own (no engine): the values come back bit for bit, host
memory is given back after backward, and backward fetches one block ahead ([Note: offloaded block inputs])."""

import torch

from shardtrain.activations import HostOffload, apply_checkpointing
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.plan.policies import ActivationPolicy

B, T, D, LAYERS = 2, 16, 32, 3


def _run(policy: ActivationPolicy, offload: HostOffload | None = None):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=T, d_model=D, n_layer=LAYERS, n_head=4))
    apply_checkpointing(list(model.blocks), policy, offload)
    x = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_round_trip_is_bitwise_and_host_memory_is_given_back():
    want = _run(ActivationPolicy("none"))
    for recompute in ("full", "selective"):
        offload = HostOffload(torch.device("cpu"))
        loss, grads = _run(ActivationPolicy(recompute, offload_inputs=True), offload)
        assert torch.equal(loss, want[0])
        assert all(torch.equal(grads[n], g) for n, g in want[1].items()), recompute
        assert offload.offloaded == LAYERS  # one input (the residual stream) per block
        assert offload.peak_host_bytes == LAYERS * B * T * D * 4
        assert offload.host_bytes == 0


def test_backward_fetches_one_block_ahead():
    """Unpacking block k's input fetches block k and starts block k-1, so each block's inputs are on the device
    before backward reaches it."""
    offload = HostOffload(torch.device("cpu"))
    fetched: list[list[int]] = []
    blocks: list = []
    fetch = offload._fetch

    def recording(block):
        if not any(block is b for b in blocks):
            blocks.append(block)
        fetched.append([i for i, b in enumerate(blocks) if b is block])
        fetch(block)

    offload._fetch = recording
    _run(ActivationPolicy("full", offload_inputs=True), offload)
    # backward unpacks the last block first: (its own, the one before), then the one before's (own, ahead), ...
    assert fetched == [[0], [1], [1], [2], [2]], fetched

"""Model code nobody here wrote, unchanged, on a mesh: transformers' GPT-2, BERT, Llama, Mixtral.

Tiny configurations with random weights (no download): a data-parallel GPT-2 trained with
AdamW (eager with ``dm.ddp_hooks``, and under ``dm.compile``), greedy ``generate`` with an
end-of-sequence token, and a training step of a BERT-style encoder, a Llama-style
decoder and a Mixtral-style mixture of experts (whose grouped matmuls fake tensors refuse
in float32: their plans are learned from the ranks), each equal to the same code run locally.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.tiny_configs import DECODER
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

import dask_monarch as dm

pytestmark = pytest.mark.timeout(600)

STEPS = 4
DP = 2


def _gpt2_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _llama_config() -> LlamaConfig:
    return LlamaConfig(**DECODER)


def _batch(step: int) -> torch.Tensor:
    """The global batch of a step: 4 sequences of 8 tokens, none of them padding."""
    return torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def gpt2_init():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in GPT2LMHeadModel(_gpt2_config()).state_dict().items()}


def _train_locally(init, make_optimizer):
    model = GPT2LMHeadModel(_gpt2_config())
    model.load_state_dict(init)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _train_on_mesh(mesh, init, make_optimizer, compiled):
    """Data-parallel: each rank trains on its half of the global batch, gradients averaged
    by ``dm.ddp_hooks``; returns the mean losses, the weights and the number of traces."""
    traces = 0
    with mesh.activate():
        model = GPT2LMHeadModel(_gpt2_config())
        model.load_state_dict(init)  # local tensors copied into mesh parameters
        optimizer = make_optimizer(model.parameters())
        hooks = dm.ddp_hooks(model, "dp")
        me = mesh.rank("dp").reshape(1)

        def step(ids):
            shard = ids.view(DP, -1, ids.shape[1]).index_select(0, me).squeeze(0)
            # transformers checks for padding when no mask is given: a value the ranks hold
            # (an implicit fetch each step), which a compiled function may not read
            mask = torch.ones_like(shard) if compiled else None
            loss = model(shard, attention_mask=mask, labels=shard).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        if compiled:
            step = dm.compile(step)
            trace = step._trace

            def counted(*args):
                nonlocal traces
                traces += 1
                return trace(*args)

            step._trace = counted
        losses = [step(torch.tensor(_batch(s).tolist())) for s in range(STEPS)]
        losses = [dm.inspect(loss.reduce("dp", "avg")).item() for loss in losses]
        replicas = [[dm.inspect(p.detach(), dp=r) for r in range(DP)] for p in model.parameters()]
        hooks.remove()
    assert all(torch.equal(a, b) for a, b in replicas)  # every replica holds the same weights
    return losses, [a for a, _ in replicas], traces


def _equal_training(local, losses, weights):
    local_losses, local_weights = local
    assert losses == pytest.approx(local_losses, rel=1e-5)
    # Adam divides by the gradient's running scale: the half-batch means, averaged, differ
    # from the full batch's mean in the last bits, and such bits grow to ~1e-5
    for a, b in zip(weights, local_weights):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_tiny_gpt2_trains_data_parallel_with_default_adamw_as_locally(mesh2, gpt2_init):
    mesh = mesh2.rename(gpu="dp")
    make = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731 (the default form)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)  # transformers' padding check
        losses, weights, _ = _train_on_mesh(mesh, gpt2_init, make, compiled=False)
    _equal_training(_train_locally(gpt2_init, make), losses, weights)


def test_tiny_gpt2_compiled_step_replays_and_trains_as_locally(mesh2, gpt2_init):
    mesh = mesh2.rename(gpu="dp")
    make = lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", dm.CompileWarning)  # it must replay, not give up
        losses, weights, traces = _train_on_mesh(mesh, gpt2_init, make, compiled=True)
    # the step that makes the optimizer's state, then the next, which makes nothing that
    # outlives it (the buckets ddp_hooks lent die with the step) and replays from then on
    assert traces == 2
    _equal_training(_train_locally(gpt2_init, make), losses, weights)


def test_tiny_gpt2_generates_the_same_tokens_as_locally(mesh2, gpt2_init):
    local = GPT2LMHeadModel(_gpt2_config()).eval()
    local.load_state_dict(gpt2_init)
    prompt = torch.tensor([[5, 9, 17, 33], [40, 2, 2, 7]])
    eos = int(local(prompt).logits[0, -1].argmax())  # so the first sequence ends early
    want = local.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)  # stopping criteria, per token
        model = GPT2LMHeadModel(_gpt2_config()).eval()
        model.load_state_dict(gpt2_init)
        got = model.generate(
            torch.tensor(prompt.tolist()), max_new_tokens=6, do_sample=False, eos_token_id=eos
        )
        got = dm.inspect(got, gpu=1)
    assert torch.equal(got, want)
    assert (want[0] == eos).any()  # the end-of-sequence path was taken


def _a_training_step(make_model, ids):
    """Loss and gradients of one step, and the weights after one AdamW step."""
    model = make_model()
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    return loss.detach(), grads, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("family", ["bert", "llama", "mixtral"])
def test_bert_llama_and_mixtral_training_steps_equal_local(mesh2, family):
    if family == "bert":
        config = BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        cls = BertForMaskedLM
    elif family == "llama":
        config = _llama_config()
        cls = LlamaForCausalLM
    else:
        config = MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
        cls = MixtralForCausalLM
    torch.manual_seed(0)
    init = cls(config).state_dict()

    def make_model():
        model = cls(config)
        model.load_state_dict(init)
        return model

    ids = _batch(0)
    want = _a_training_step(make_model, ids)
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)
        got = _a_training_step(make_model, torch.tensor(ids.tolist()))
        got = dm.inspect(got, gpu=1)
        fetched = mesh2._session.implicit_fetches
        _a_training_step(make_model, torch.tensor(ids.tolist()))  # learned plans: no fetch
        assert mesh2._session.implicit_fetches == fetched
    loss, grads, weights = got
    assert torch.allclose(loss, want[0], rtol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, want[1]))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(weights, want[2]))


def test_a_model_loaded_with_from_pretrained_under_a_mesh_trains_as_locally(mesh2, tmp_path):
    """transformers builds the model on the meta device and makes each parameter with
    ``nn.Parameter(what it read)``: under ``mesh.activate()`` those stayed local, and the first
    backward refused them; they are mesh parameters now. And ``torch.device("meta")`` gave
    ``torch.tensor([])`` no device once a mesh had replaced ``torch.tensor`` (torch caches the
    functions it gives a device): a local Llama loaded after the mesh had garbage rotary
    frequencies (found by a probe of pretrained models)."""
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path)
    ids = _batch(0)
    want = _a_training_step(lambda: LlamaForCausalLM.from_pretrained(tmp_path), ids)
    with torch.device("meta"):
        assert torch.tensor([]).device.type == "meta"  # torch.tensor is the mesh's wrapper here
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)
        got = _a_training_step(lambda: LlamaForCausalLM.from_pretrained(tmp_path), ids)
        assert all(isinstance(p, dm.Tensor) for p in got[2])
        got = dm.inspect(got, gpu=1)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def test_a_model_built_locally_moves_onto_the_mesh_with_put(mesh2, gpt2_init):
    """``dm.put(model)``: its parameters and buffers placed, tied ones still tied, as
    ``model.to(device)`` moves them (``model._apply(dm.put)`` was refused: a local parameter
    cannot hold a mesh tensor as its ``.data``)."""

    def make_model():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(_gpt2_config())
        model.load_state_dict(gpt2_init)
        return model

    ids = _batch(0)
    want = _a_training_step(make_model, ids)
    local = make_model()
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)
        model = dm.put(local)
        assert model is local and model.lm_head.weight is model.transformer.wte.weight
        assert all(isinstance(t, dm.Tensor) for t in (*model.parameters(), *model.buffers()))
        got = dm.inspect(_a_training_step(lambda: model, ids), gpu=1)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))

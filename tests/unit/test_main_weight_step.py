"""runtime.training.main_weights: an optimizer step on fp32 main copies of bf16 weights is, bit for
bit, the fp32 optimizer's step fed the same gradients, rounded back into the bf16 weights; updates
smaller than bf16's resolution accumulate in the main copy instead of being lost."""
import torch

from runtime.training.main_weights import MAIN_KEY, compute_inputs, step_on_main


def _pair(optimizer, lr: float):
    torch.manual_seed(0)
    low = torch.nn.Parameter(torch.randn(8, 5).to(torch.bfloat16))
    ref = torch.nn.Parameter(low.detach().float())
    return low, ref, optimizer([low], lr=lr), optimizer([ref], lr=lr)


def test_the_step_is_the_fp32_step_rounded():
    for optimizer in (torch.optim.AdamW, torch.optim.SGD):
        low, ref, opt, ref_opt = _pair(optimizer, 1e-2)
        for _ in range(4):
            grad = torch.randn(8, 5).to(torch.bfloat16)
            low.grad, ref.grad = grad.clone(), grad.float()
            step_on_main(opt)
            ref_opt.step()
            assert torch.equal(opt.state[low][MAIN_KEY], ref.detach())
            assert torch.equal(low.detach(), ref.detach().to(torch.bfloat16))
            assert low.dtype == low.grad.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in opt.state[low].values() if v.dim())


def test_updates_below_bf16_resolution_accumulate_in_the_main_copy():
    low, ref, opt, _ = _pair(torch.optim.SGD, 1e-4)
    start = low.detach().clone()
    for _ in range(3):
        low.grad = torch.ones(8, 5, dtype=torch.bfloat16)
        step_on_main(opt)
    moved = opt.state[low][MAIN_KEY] - start.float()
    torch.testing.assert_close(moved, torch.full((8, 5), -3e-4), rtol=1e-3, atol=1e-7)


def test_the_main_copy_is_in_the_optimizer_state_dict():
    low, _, opt, _ = _pair(torch.optim.AdamW, 1e-3)
    low.grad = torch.ones_like(low)
    step_on_main(opt)
    saved = opt.state_dict()["state"][0]
    assert saved[MAIN_KEY].dtype == torch.float32 and saved[MAIN_KEY].shape == low.shape


def test_floating_inputs_are_cast_and_tokens_kept():
    tokens, images = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    out = compute_inputs((tokens, images))
    assert out[0].dtype == torch.long and out[1].dtype == torch.bfloat16

"""Diffusion transformers (planner.models.dit): DiT-XL/2's published size (675M parameters,
118.6 GFLOPs per 256x256 image forward, counted as multiply-adds as the paper counts them), plans
for 8 and 64 H100s with tensor parallelism among the searched strategies, the adaLN modulation
priced as the tensor-parallel rewrite runs it (weight 1/tp per rank, its output all-gathered),
and one-line errors for what a DiT cannot take."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cost_model.layers.layer_cost import profile_layer
from passes.capture.trace import capture
from planner.api import _model_costs, plan
from planner.cli import main
from planner.models.dit import DIT_PRESETS, DiTConfig
from planner.models.presets import build_model, example_batch, get_config
from planner.search.costs import ModelCosts

XL = get_config("dit-xl-2")


def test_the_xl_preset_has_the_published_parameter_count():
    """675M: the paper's count, with its 2C-channel output (the learned variance) and its
    extra class row for classifier-free guidance, is 675.1M; without them 674.8M."""
    model = build_model(XL, device="meta")
    assert all(p.is_meta for p in model.parameters())  # built without allocating weights
    count = sum(p.numel() for p in model.parameters())
    assert count == 674_815_120
    assert round(count / 1e6) == 675
    costs, *_ = _model_costs("dit-xl-2", None, None, None)
    assert costs.param_count() == count  # one block captured, counted 28 times


def test_the_xl_forward_flops_match_the_paper():
    """Per image forward: 118.6 GFLOPs in the paper (multiply-adds), i.e. twice that in FLOPs;
    written out, 28 blocks of 12h²N (qkv, proj, MLP) + 2N²h (scores, values) + 6h² (adaLN)."""
    costs, *_ = _model_costs("dit-xl-2", None, None, None)
    block = costs.block_profile(1)
    forward = XL.layers * sum(op.fwd_flops for op in block.ops) / block.batch
    forward += sum(sum(op.fwd_flops for op in p.ops) / p.batch for p in costs.ends.values())
    h, n = XL.hidden, XL.seq
    formula = 2 * XL.layers * (12 * h * h * n + 2 * n * n * h + 6 * h * h)
    assert forward == pytest.approx(2 * 118.6e9, rel=0.01)
    assert forward == pytest.approx(formula, rel=0.01)


@pytest.mark.parametrize("gpus", [8, 64])
def test_the_xl_plans_on_h100s_with_tensor_parallelism_searched(gpus):
    best = plan("dit-xl-2", gpus, cluster="h100-sxm-dgx")[0]
    assert best.gpus == gpus and best.dp * best.tp * best.pp == gpus
    assert (best.seq, best.sequences, best.cp) == (256, False, 1)  # patches; counted in images
    assert "samples/s" in str(best) and "256 patches" in str(best)
    assert not any("without tensor parallelism" in note for note in best.notes)
    fixed = plan("dit-xl-2", gpus, cluster="h100-sxm-dgx", fix={"tp": 8, "strategy": "tp"})[0]
    blocks = [s for st in fixed.stages for layer, s in zip(st.layers, st.strategies)
              if layer.startswith("blocks.")]
    assert fixed.tp == 8 and blocks == ["tp"] * XL.layers


def test_the_cli_plans_the_xl_on_64_gpus(capsys):
    assert main(["plan", "--model", "dit-xl-2", "--gpus", "64", "--cluster", "h100-sxm-dgx",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["model"] == "dit-xl-2" and planned["global_batch"] == 256
    assert planned["params"] == 674_815_120


def test_the_modulation_is_column_parallel_and_gathered():
    """Under tp the block's parameters are 1/tp per rank but for the row-parallel biases (the
    modulation's weight and bias included), and its forward gathers [b, 6h]: one all-gather."""
    cfg = get_config("dit-tiny")
    model = build_model(cfg, device="meta")
    captured = capture(model, example_batch(cfg, 1, device="meta"))
    block = captured.blocks[0]
    h, ffn = cfg.hidden, cfg.ffn_hidden
    for tp in (2, 4):
        profile = profile_layer(captured, block, tp)
        weights = 3 * h * h + h * h + 2 * h * ffn + 6 * h * h
        sharded_biases = 3 * h + ffn + 6 * h
        assert profile.params == (weights + sharded_biases) // tp + 2 * h
        gathers = [(c.phase, c.nbytes) for c in profile.collectives if c.kind == "all_gather"]
        assert gathers == [("fwd", 4.0 * 6 * h)]  # fp32, captured at one image


def test_the_cross_attention_variant_is_tensor_and_sequence_parallel():
    """Its cross-attention pairs up as the self-attention does (q from the patches, fused kv
    from the conditioning sequence, column-parallel; proj row-parallel): one gather per block,
    the modulation's, and sequence parallelism applies."""
    cfg = get_config("dit-tiny-cross")
    costs, *_ = _model_costs(cfg, None, None, None)
    for tp in (2, 4):
        profile = costs.block_profile(tp)
        assert profile is not None, costs.tp_errors.get(tp)
        assert sum(c.kind == "all_gather" for c in profile.collectives) == 1
        assert costs.supports_sp(tp, 1, cfg.seq), costs.sp_error(tp)
    latents, t, context, noise = cfg.example(2)
    assert context.shape == (2, 12, 32) and context.is_floating_point()


class ReferenceFormBlock(nn.Module):
    """The reference code's form: chunk right after the linear, each part unsqueezed where it
    modulates; its MLP a GELU pair."""

    def __init__(self, hidden: int = 32, modulation: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.mod = nn.Sequential(nn.SiLU(), nn.Linear(hidden, modulation * hidden))

    def forward(self, x, c):
        shift, scale, gate = self.mod(c).chunk(3, dim=1)
        h = self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        return x + gate.unsqueeze(1) * self.fc2(F.gelu(self.fc1(h)))


class Conditioned(nn.Module):
    def __init__(self, hidden: int = 32, blocks: int = 2):
        super().__init__()
        self.embed, self.cond = nn.Linear(4, hidden), nn.Embedding(10, hidden)
        self.blocks = nn.ModuleList(ReferenceFormBlock(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, 4)

    def forward(self, x, y, target):
        x, c = self.embed(x), self.cond(y)
        for block in self.blocks:
            x = block(x, c)
        return F.mse_loss(self.head(x), target)


def _conditioned_costs(hidden: int) -> ModelCosts:
    model = Conditioned(hidden)
    inputs = (torch.randn(1, 8, 4), torch.zeros(1, dtype=torch.long), torch.randn(1, 8, 4))
    captured = capture(model, inputs)
    return ModelCosts(captured, len(captured.blocks), 4)


def test_a_modulation_chunked_right_after_its_linear_is_gathered_too():
    costs = _conditioned_costs(32)
    for tp in (2, 4):
        profile = costs.block_profile(tp)
        assert profile is not None, costs.tp_errors.get(tp)
        assert sum(c.kind == "all_gather" for c in profile.collectives) == 1


def test_a_modulation_tp_does_not_divide_stays_whole_on_every_rank():
    """3 x 10 modulation features over 4 ranks: the linear is kept whole (no all-gather), the
    MLP beside it cut (its 40 features divide)."""
    costs = _conditioned_costs(10)
    for tp, gathers in ((2, 1), (4, 0)):
        profile = costs.block_profile(tp)
        assert profile is not None, costs.tp_errors.get(tp)
        assert sum(c.kind == "all_gather" for c in profile.collectives) == gathers


@pytest.mark.parametrize("change,words", [
    ({"seq": 512}, "seq does not apply to dit-xl-2: a DiT's sequence is its latent's patches"),
    ({"vocab": 100}, "vocab does not apply to dit-xl-2"),
    ({"kv_heads": 4}, "kv_heads does not apply"),
    ({"heads": 7}, "hidden size 1152 is not divisible by heads 7"),
    ({"latent": 33}, "latent side 33 is not divisible by patch 2"),
])
def test_what_a_dit_cannot_take_is_a_one_line_error(change, words):
    with pytest.raises(ValueError, match=words):
        get_config("dit-xl-2", **change)


def test_context_parallelism_is_refused_for_latents():
    with pytest.raises(ValueError, match="cp=2: dit-tiny's inputs are latent images"):
        plan("dit-tiny", 4, cluster="cpu-gloo", fix={"cp": 2})


def test_the_cli_refuses_a_sequence_length_for_a_dit(capsys):
    assert main(["plan", "--model", "dit-tiny", "--gpus", "2", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seq does not apply to dit-tiny" in err


def test_presets_are_listed_and_tiny_trains_a_step():
    assert {"dit-tiny", "dit-tiny-cross", "dit-xl-2"} <= set(DIT_PRESETS)
    with pytest.raises(ValueError, match="known presets: .*dit-tiny, dit-tiny-cross, dit-xl-2"):
        get_config("dit-small")
    cfg = get_config("dit-tiny")
    assert isinstance(cfg, DiTConfig) and cfg.seq == 16
    torch.manual_seed(0)
    model, batch = cfg.build()
    loss = model(*batch)
    loss.backward()
    assert loss.item() == pytest.approx(1.0, abs=0.1)  # adaLN-Zero: predicts 0 against N(0, 1)
    assert not model.blocks[0].adaLN_modulation[1].weight.any()
    final = model.final_layer.linear.weight  # zero too, the first to learn
    assert not final.any() and final.grad.abs().sum() > 0


def test_fxpar_train_says_a_dit_is_not_trained_on_token_files():
    from planner.training.config import ConfigError, from_dict
    with pytest.raises(ConfigError, match="'dit-tiny' is a diffusion transformer: fxpar train "
                                          "trains language models on token files"):
        from_dict({"model": {"preset": "dit-tiny"}, "data": {"path": "data/x"}}, "run.toml")
